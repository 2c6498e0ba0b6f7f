"""felixctl: the command line for felix-redis (streams, groups, records, and a demo)."""
