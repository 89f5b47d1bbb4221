"""The trainer process's share of the machine: how torch's idle OpenMP threads wait (``omp_wait``), the
host heap's free pages given back (``host_heap``), and a barrier with a time limit (``rank_barrier``)."""
