"""`crabd image ...`: the images of a state directory (the root file
systems sandboxes start from), worked on directly, without the daemon.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ._common import JsonOpt, StateDir, err, guard, out, print_json, runtime

image_app = typer.Typer(no_args_is_help=True, help="Images: root file systems sandboxes start from.")


@image_app.command("import")
def image_import(source: str = typer.Argument(..., help="directory, tarball, or docker://NAME[:TAG]"),
                 name: str = typer.Option(..., "--name", help="image name"),
                 state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Import a root file system as an image."""
    rt = runtime(state_dir)
    with err.status(f"importing {source} as {name} ..."):
        img = guard(lambda: rt.images.import_path(source, name), as_json)
    _image_out(img, as_json)


@image_app.command("build")
def image_build(distro: str = typer.Argument(..., help="only 'debian' for now"),
                name: str = typer.Option(..., "--name"),
                packages: str = typer.Option("python3,python3-venv,python3-pip,git,curl,ca-certificates", "--packages",
                                             help="comma-separated Debian packages added to minbase"),
                suite: str = typer.Option("bookworm", "--suite"),
                mirror: str = typer.Option("http://deb.debian.org/debian", "--mirror"),
                state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Build an image with debootstrap (~45 s and ~420 MB for the default packages)."""
    if distro != "debian":
        err.print(f"[red]error:[/red] unknown distro {distro!r}; only 'debian' is supported")
        raise typer.Exit(2)
    rt = runtime(state_dir)
    with err.status("debootstrap ...") as st:
        img = guard(lambda: rt.images.build_debian(name, suite=suite, mirror=mirror,
                                                    packages=[p.strip() for p in packages.split(",") if p.strip()],
                                                    progress=lambda line: st.update(f"debootstrap: {line[:70]}")),
                     as_json)
    _image_out(img, as_json)


def _image_out(img: Any, as_json: bool) -> None:
    if as_json:
        print_json(img.to_dict())
    else:
        out.print(f"image [bold]{img.name}[/bold]: {img.files} entries, {img.size_bytes / 1e6:.1f} MB ({img.source})")


@image_app.command("ls")
def image_ls(state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """List images."""
    rt = runtime(state_dir)
    imgs = guard(rt.images.list, as_json)
    if as_json:
        print_json({"images": [i.to_dict() for i in imgs]})
        return
    from rich.table import Table
    t = Table(box=None, header_style="bold")
    for col in ("name", "size", "entries", "source"):
        t.add_column(col, overflow="fold")
    for i in imgs:
        t.add_row(i.name, f"{i.size_bytes / 1e6:.0f} MB", str(i.files), i.source)
    out.print(t)


@image_app.command("rm")
def image_rm(name: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Remove an image (refused while a sandbox uses it)."""
    rt = runtime(state_dir)
    guard(lambda: rt.images.remove(name), as_json)
    if as_json:
        print_json({"removed": name})
    else:
        out.print(f"removed image {name}")
