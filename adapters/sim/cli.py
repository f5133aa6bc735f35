"""``deo simulate FILE``: run one scenario in the simulator and print its metrics."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the command's arguments on ``parser``."""


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    raise NotImplementedError
