"""The ``kvrouter`` command line: one subcommand per service and tool, and the flags they share."""
