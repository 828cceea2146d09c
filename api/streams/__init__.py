"""The command stream, ``POST /batch``'s runner and the live streams (loads, decisions), with their answer budgets."""
