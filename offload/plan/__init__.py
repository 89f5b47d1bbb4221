"""One memory plan: every region's bytes and where it lives, from the config, the machine and the daemon's
budget; the builder allocates from it and ``offload estimate`` prints it ([Note: memory plan]).

- ``memory``: the plan itself: the layout, the optimizer state's tier and window, stage 3's param tier;
- ``tier_plan``: what one tier is asked for (its regions, host and swap bytes, a session's quota);
- ``budget``, ``daemon_pool``: the host budget the window is sized from, this machine's or a daemon's pool;
- ``estimate``, ``fit``: ``offload estimate``'s rows for every stage and offload choice, and its verdicts.
"""
