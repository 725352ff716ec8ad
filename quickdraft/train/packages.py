"""Third-party training text: the ``.py`` sources of installed packages, with a manifest.

``python -m quickdraft.train.packages --out DIR --manifest FILE fastapi sqlalchemy ...``
copies each named package's source files (tests and vendored code left out, the same
rule as the bench's out-of-domain prompts) to ``DIR/<package>/...`` and writes a manifest
with each package's version, licence, files and bytes. ``DIR`` is then ``--data`` for
``quickdraft train draft``; the manifest goes next to the trained draft.

The packages the bench draws its out-of-domain prompts from are refused: a draft trained
on them would make the out-of-domain category in-domain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..sources import OOD_PACKAGES, package_files, package_license
from .textdata import TrainInputError


def export_package_sources(packages: list[str], out_dir: Path, max_bytes: int | None = None) -> dict:
    """Copy the sources of ``packages`` under ``out_dir``; return the manifest.

    ``max_bytes`` caps each package (files are taken in a fixed hashed order until the cap),
    so one large package does not drown the rest.
    """
    from importlib import metadata

    out_dir = Path(out_dir)
    refused = sorted({s.partition(":")[0] for s in packages} & set(OOD_PACKAGES))
    if refused:
        raise TrainInputError(f"{', '.join(refused)} supply the bench's out-of-domain prompts; "
                              "leave them out of training data")
    manifest: dict = {"packages": [], "excluded_bench_packages": list(OOD_PACKAGES),
                      "rule": "package .py files; tests, vendored code and conftest.py left out",
                      "max_bytes_per_package": max_bytes}
    for spec in packages:
        dist_name, _, package = spec.partition(":")
        package = package or dist_name
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise TrainInputError(f"package {dist_name} is not installed; pip install it or "
                                  "leave it out") from None
        files = []
        total = 0
        for rel, path in package_files(dist, package):
            size = path.stat().st_size
            if size == 0 or (max_bytes is not None and total + size > max_bytes):
                continue
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
            files.append(rel)
            total += size
        if not files:
            raise TrainInputError(f"package {package} has no .py sources under a top-level "
                                  f"'{package}' directory; name its import package as "
                                  f"{dist_name}:IMPORT_NAME")
        manifest["packages"].append({"package": package, "distribution": dist.metadata["Name"],
                                     "version": dist.version,
                                     "license": package_license(dist), "files": len(files),
                                     "bytes": total})
    manifest["bytes"] = sum(p["bytes"] for p in manifest["packages"])
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quickdraft.train.packages", description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="+", help="installed distributions, as NAME or DIST:IMPORT_NAME (e.g. pytest:_pytest)")
    parser.add_argument("--out", required=True, type=Path, help="directory to copy the sources to")
    parser.add_argument("--manifest", required=True, type=Path, help="JSON manifest to write (outside --out)")
    parser.add_argument("--max-bytes", type=int, default=None, help="cap per package")
    args = parser.parse_args(argv)
    if args.manifest.resolve().is_relative_to(args.out.resolve()):
        print("error: --manifest must be outside --out, or training would read it as text", file=sys.stderr)
        return 2
    try:
        manifest = export_package_sources(args.packages, args.out, args.max_bytes)
    except TrainInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.manifest.write_text(json.dumps(manifest, indent=1) + "\n")
    for p in manifest["packages"]:
        print(f"{p['package']} {p['version']} ({p['license']}): {p['files']} files, {p['bytes']:,} bytes")
    print(f"{manifest['bytes']:,} bytes in {args.out}; manifest {args.manifest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
