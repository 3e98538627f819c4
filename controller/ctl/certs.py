"""`controllerctl certs`: make the private CA and the certificates of one cluster (runwarden/certs.py).

    controllerctl certs init DIR [--name NAME] [--days N] [--force]
    controllerctl certs issue DIR STEM --role server --host HOST [--host HOST ...] [--cn NAME] [--days N]
    controllerctl certs issue DIR STEM --role admin|reader [--cn NAME]

`init` writes DIR/ca.pem and DIR/ca.key (0600). `issue` writes DIR/STEM.pem and DIR/STEM.key (or
into --out). See deploy/tls/README.md for which certificate goes where. Works offline.
Exit codes: 0 written, 1 refused (e.g. the CA exists, no CA, bad host), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runwarden.certs import ROLES, CertError, create_ca, issue


def add_parser(sub: Any) -> None:
    p = sub.add_parser("certs", help="create a cluster CA and its server/admin/reader certificates")
    verbs = p.add_subparsers(dest="certs_verb", metavar="VERB", required=True)
    init = verbs.add_parser("init", help="create the cluster CA (ca.pem, ca.key)")
    init.add_argument("dir", type=Path)
    init.add_argument("--name", default="runwarden cluster CA")
    init.add_argument("--days", type=int, default=3650)
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    iss = verbs.add_parser("issue", help="sign a certificate with the cluster CA")
    iss.add_argument("dir", type=Path, help="the CA directory (from `certs init`)")
    iss.add_argument("stem", help="file name stem: STEM.pem and STEM.key")
    iss.add_argument("--role", choices=ROLES, required=True)
    iss.add_argument("--cn", default="", help="common name (default: STEM)")
    iss.add_argument("--host", action="append", default=[], help="DNS name or IP in the certificate (server)")
    iss.add_argument("--days", type=int, default=365)
    iss.add_argument("--out", type=Path, help="directory for the new files (default: the CA directory)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.certs_verb == "init":
            files = create_ca(args.dir, name=args.name, days=args.days, overwrite=args.force)
        else:
            files = issue(
                args.dir,
                args.stem,
                role=args.role,
                common_name=args.cn,
                hosts=args.host,
                days=args.days,
                out_dir=args.out,
            )
    except (CertError, OSError) as exc:
        print(f"controllerctl certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {files.cert} and {files.key} (key mode 0600)")
    return 0
