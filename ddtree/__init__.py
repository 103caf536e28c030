"""DDTree serving: the `ddtree` command and what its subcommands share."""
