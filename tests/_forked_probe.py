"""A module that ``tests/test_harness.py`` runs on forked ranks (``testing.forked_module``): it prints what it sees
and ends as its first argument asks."""

import os
import signal
import sys
import time


def main(mode: str) -> None:
    from megatron_peakflat.testing.distributed import _bindable

    rank = int(os.environ.get("RANK", "0"))
    port = int(os.environ["MASTER_PORT"])
    print(f"rank={os.environ.get('RANK')} world={os.environ.get('WORLD_SIZE')} port_held={not _bindable(port)} "
          f"agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')} "
          f"probe={os.environ.get('PEAKFLAT_PROBE')} cwd={os.getcwd()} argv={sys.argv[1:]} "
          f"leads_group={os.getpgrp() == os.getpid()} main={__name__}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    if mode == "exit-3":
        sys.exit(3)
    if mode == "raise-on-1" and rank == 1:
        raise ValueError("boom on rank one")
    if mode == "sigkill-on-1" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode in ("raise-on-1", "sigkill-on-1", "sleep"):
        time.sleep(600)  # stopped by the launcher once the other rank failed, or at the timeout


if __name__ == "__main__":
    main(sys.argv[1])
