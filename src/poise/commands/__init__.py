"""Subcommands of `poise`, one module each."""
