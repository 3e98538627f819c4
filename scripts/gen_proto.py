"""Generate the Python stubs for proto/runwarden/v1/*.proto into runwarden/v1/.

    python scripts/gen_proto.py           # write the stubs
    python scripts/gen_proto.py --check   # exit 1 if the committed stubs differ from the .proto

The stubs are committed so that a fresh install imports them with no build step; CI runs
--check so the .proto and the stubs can never disagree.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PKG = Path("runwarden") / "v1"


def generate(out_root: Path) -> list[Path]:
    protos = sorted((PROTO_DIR / "runwarden" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"--mypy_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / OUT_PKG
    return sorted(p for p in out.iterdir() if p.suffix in (".py", ".pyi"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        target = ROOT / OUT_PKG
        if args.check:
            stale = [
                p.name
                for p in generated
                if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name, shallow=False)
            ]
            if stale:
                print(
                    f"stubs out of date with proto/: {', '.join(stale)}; run scripts/gen_proto.py",
                    file=sys.stderr,
                )
                return 1
            print(f"stubs match proto/ ({len(generated)} files)")
            return 0
        for p in generated:
            shutil.copyfile(p, target / p.name)
        print(f"wrote {len(generated)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
