#!/usr/bin/env python3
"""scripts/lint_imports.py - lint-imports (import-linter) on the package as it installs.

execution/, controld/ and snapshots/ install as zz.execution, zz.controld and zz.snapshots
(pyproject.toml [tool.setuptools.package-dir]). import-linter finds a package's modules by
walking its folder, so on the checkout it sees zz/ alone and stops at "Missing layer ...
zz.controld". This lays the installed tree out in a temporary directory, as symlinks into
the checkout, and runs lint-imports there on the contracts of pyproject.toml
[tool.importlinter] (docs/layout.md). Arguments go to lint-imports (e.g. --verbose)."""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_tree(root: Path) -> None:
    """zz/ and each mapped package under `root` as they would be in site-packages."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        dest = root.joinpath(*package.split("."))
        if "." in package:  # a whole folder becomes a subpackage
            dest.symlink_to(REPO / folder, target_is_directory=True)
            continue
        dest.mkdir()  # the root package: its files, next to which the subpackages go
        for entry in (REPO / folder).iterdir():
            if entry.name != "__pycache__":
                (dest / entry.name).symlink_to(entry)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zz-lint-imports-") as tmp:
        installed_tree(Path(tmp))
        # import-linter puts the working directory first on sys.path, ahead of the editable
        # install's finder, so `zz` resolves to the tree above.
        os.chdir(tmp)
        sys.path.insert(0, tmp)
        from importlinter.cli import lint_imports

        return lint_imports(
            config_filename=str(REPO / "pyproject.toml"),
            no_cache=True,
            no_logo=True,
            verbose="--verbose" in sys.argv[1:],
        )


if __name__ == "__main__":
    sys.exit(main())
