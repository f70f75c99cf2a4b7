"""Before torchrun agents meet in etcd: is the server one they can use?

    python -m mingpt_ddp.runtime.etcd_check 10.0.0.5:2379

torchrun's etcd and etcd-v2 rendezvous backends speak etcd's v2 API, which etcd 3.4 and 3.5 serve
when started with --enable-v2 and etcd 3.6 removed; against such a server the agents fail at
rendezvous with a client error that does not say why. This check says it in one line."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def etcd_v2_problem(endpoint: str, timeout_s: float = 5.0) -> str:
    """Why torchrun's etcd and etcd-v2 rendezvous cannot meet at the etcd server at endpoint
    (host:port or a URL), or "" if they can. Both speak etcd's v2 API: etcd 3.4 and 3.5 serve it
    when started with --enable-v2, and etcd 3.6 removed it (the agents would fail at rendezvous
    with a client error that does not say so)."""
    url = endpoint.rstrip("/") if "://" in endpoint else f"http://{endpoint}"
    try:
        with urllib.request.urlopen(f"{url}/version", timeout=timeout_s) as reply:
            version = json.load(reply)["etcdserver"]
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return (
            f"cannot ask {url} for its etcd version ({type(e).__name__}: {e}); "
            "is etcd running there?"
        )
    if major_minor >= (3, 6):
        return (
            f"etcd {version} at {url} has no v2 API (etcd 3.6 removed it), "
            "which torchrun's etcd and etcd-v2 rendezvous need; "
            "run etcd 3.5 with --enable-v2 (pip install -e '.[etcd]' brings one) "
            "or use --rdzv_backend=c10d"
        )
    try:
        urllib.request.urlopen(f"{url}/v2/keys", timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return f"etcd {version} at {url} runs without its v2 API; start it with --enable-v2"
    except OSError as e:
        return f"cannot reach {url}/v2/keys ({type(e).__name__}: {e})"
    return ""


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m mingpt_ddp.runtime.etcd_check HOST:PORT")
    problem = etcd_v2_problem(sys.argv[1])
    try:
        import etcd  # noqa: F401 - python-etcd, the client torchrun's etcd backends import
    except ImportError:
        problem = (
            problem or "torchrun's etcd rendezvous needs python-etcd: pip install -e '.[etcd]'"
        )
    print(
        f"error: {problem}"
        if problem
        else f"etcd | {sys.argv[1]} serves the v2 API torchrun's etcd and etcd-v2 rendezvous need",
        file=sys.stderr if problem else sys.stdout,
    )
    sys.exit(1 if problem else 0)
