"""Waiting for a group of launched processes, as the multi-process tests launch them."""


def finish(procs, what: str, *, timeout_s: float) -> list[str]:
    """Each process's output once all have exited; any still running at the timeout is killed,
    and a non-zero exit fails the test with that process's output."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{what} process {i} exited with {p.returncode}:\n{out[-4000:]}"
    return outs
