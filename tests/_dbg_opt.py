import faulthandler, sys, tempfile
sys.path.insert(0, "/work/main")
from megatron_peakflat.testing.distributed import run_distributed
import tests.test_optimizer_megatron as t

def main(rank, world, d):
    import faulthandler
    faulthandler.dump_traceback_later(100, exit=True)
    return t._rank_main(rank, world, d)

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(run_distributed(main, 2, d, timeout=150)[0].keys())
