"""`treeflash-export`: build artifacts from checkpoints (the build command arrives with the export work)."""

from __future__ import annotations

import sys

import click

from .errors import TreeFlashError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main():
    """Export TreeFlash verifier/drafter pairs for deployment."""


@main.command("tiny-pair")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to create (must not exist).")
@click.option("--family", type=click.Choice(["qwen3", "llama"]), default="qwen3", help="Verifier architecture.")
@click.option("--layout", type=click.Choice(["treeflash", "dflash"]), default="treeflash",
              help="Drafter checkpoint layout: TreeFlash (with head) or DFlash (without).")
@click.option("--block-size", type=int, default=8, help="Drafter block size B.")
@click.option("--seed", type=int, default=0)
def tiny_pair(out, family, layout, block_size, seed):
    """Write a tiny random verifier + drafter pair (OUT/verifier, OUT/drafter), fully offline.

    For smoke tests and demos on machines with no model hub: the weights are
    random, so drafts are rarely accepted.
    """
    from pathlib import Path

    from .tiny import write_tiny_pair

    if Path(out).exists():
        click.echo(f"error: {out} already exists; remove it or choose another --out", err=True)
        sys.exit(2)
    try:
        click.echo(f"writing a tiny {family} verifier and {layout} drafter to {out} ...", err=True)
        write_tiny_pair(out, family=family, layout=layout, block_size=block_size, seed=seed)
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(out))


if __name__ == "__main__":
    main()
