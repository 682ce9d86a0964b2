"""`inferplane up` (up.py) and `inferplane status` (status.py): the local platform's subcommands."""
