"""ZeRO partitioning: where every element lives and how it moves through a step.

- ``layout``: the flat buffer, its buckets, rank shards and sub-groups; ``collectives``: the two collectives;
- ``grads``, ``unit_grads``, ``grad_tier``: gradients from autograd into the partition (stage 3's per unit,
  and on NVMe);
- ``optimizer``, ``states``, ``state_format``, ``window``: Adam over the partition, the state blocks in their
  tier and their byte layout, the window of blocks in host memory;
- ``overlap``, ``delayed``, ``block_undo``: the step under backward, the delayed update, the undo copy of
  compressed states;
- ``stage3``, ``units``, ``params``, ``shards``, ``unit_fetch``, ``external``: stage 3's units, gathered before
  use and released after, their shards wherever ``offload_param`` puts them;
- ``node_buffers``: the flat buffers of ranks on one node in shared memory.
"""
