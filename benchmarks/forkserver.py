"""One process per test worker that has imported what main.py imports, and forks each job from it.

    python benchmarks/forkserver.py SOCKET      # started by benchmarks/common.py: run_main

A tiny job of the test suite costs mostly its start: importing torch, Hydra and this package takes
about 2.5 CPU-seconds on the 2-core machines CI runs on, and its few training steps a fraction of
that; the suite runs a few hundred such jobs. This server imports them once (ranks.preload) and
listens on a Unix socket; for each job a client sends its command line, environment and folder
with the three files its stdin, stdout and stderr go to (SCM_RIGHTS). The server forks a child
per job, which forks the job itself: in its own session, in that folder and environment, it runs
the command as `python ARGV` would (ranks.run_script: a script or `-m MODULE`; ranks.py forks a
job's ranks in turn). The child sends the job's pid, then its exit status. Only run_main's jobs
come here: a test that signals a job or reads its output as it comes starts a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ranks import preload, run_script  # noqa: E402


def run_job(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the server's child: fork the job, send its pid, wait, send its status; never returns."""
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setsid()  # its own session: the client ends the whole job with one killpg
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        run_script(request["argv"], request["path"])
    conn.sendall(struct.pack("i", pid))
    _, status = os.waitpid(pid, 0)
    conn.sendall(struct.pack("i", os.waitstatus_to_exitcode(status)))
    os._exit(0)


def serve(path: str) -> None:
    preload()
    base = sys.path[1:]  # the import path a `python SCRIPT` job would have after its folder
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children reap themselves
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        print("ready", flush=True)
        while True:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            if os.fork() == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                run_job(conn, {**json.loads(message), "path": base}, fds)
            conn.close()
            for fd in fds:
                os.close(fd)


# ------------------------------------------------------------------ the client (a test worker)
_SERVER: list = []  # this process's server: [Popen, socket path], started on first use


def server_path(env: dict) -> str:
    """The socket of this process's server, started (with env) on first use; it ends with us."""
    if not _SERVER or _SERVER[0].poll() is not None:
        path = os.path.join(tempfile.mkdtemp(prefix="forkserver-"), "socket")
        proc = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE, env=env)
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the fork server did not start")
        atexit.register(proc.kill)
        _SERVER[:] = [proc, path]
    return _SERVER[1]


def server_pid() -> int | None:
    """This process's server, if it started one (a test's clean-up must leave it running)."""
    return _SERVER[0].pid if _SERVER else None


def served(env: dict, server_env: dict) -> bool:
    """Whether a job with env can be forked from a server started with server_env: the
    interpreter reads its PYTHON* variables once, at start (the import path, warnings, hash
    seed), so they must be the same."""
    python = {k for k in {*env, *server_env} if k.startswith("PYTHON")}
    return all(env.get(k) == server_env.get(k) for k in python)


def run_forked(
    cmd: list, env: dict, cwd, timeout: float, server_env: dict
) -> subprocess.CompletedProcess | None:
    """subprocess.run(cmd, capture_output=True, text=True) for `python SCRIPT ARGS`, forked from
    the server (started with server_env): the same exit status and output; after `timeout` the
    job's session is killed. None for a command it cannot serve (not such a command, or other
    PYTHON* variables)."""
    if cmd[0] != sys.executable or str(cmd[1]) == "-m" or not served(env, server_env):
        return None
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        open(os.devnull) as null,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
    ):
        conn.connect(server_path(server_env))
        request = json.dumps({"argv": [str(c) for c in cmd[1:]], "env": env, "cwd": str(cwd)})
        socket.send_fds(conn, [request.encode()], [null.fileno(), out.fileno(), err.fileno()])
        conn.settimeout(timeout)
        pid = struct.unpack("i", conn.recv(4, socket.MSG_WAITALL))[0]
        try:
            code = struct.unpack("i", conn.recv(4, socket.MSG_WAITALL))[0]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


if __name__ == "__main__":
    serve(sys.argv[1])
