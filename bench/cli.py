"""``deo bench``: every shipped scenario under every policy, side by side."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the command's arguments on ``parser``."""


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    raise NotImplementedError
