"""One memory plan: every region's bytes and where it lives, from the config, the machine and the
daemon's budget; the builder allocates from it and ``offload estimate`` prints it."""
