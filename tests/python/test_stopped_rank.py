"""A process stopped (SIGSTOP) under mpirun ends the job: its peer's next collective fails with
DEADLINE_EXCEEDED within the world's timeout, and the package's exit handler (fsdp_mpi_finish)
aborts the job instead of waiting in MPI_Finalize for the stopped process. Exit 77 without
numpy or mpirun.

    test_stopped_rank.py MPIEXEC
"""
import os
import signal
import subprocess
import sys
import tempfile
import time

TRAINER = r'''
import os, sys
import libfsdp
world = libfsdp.World.mpi(timeout_seconds=3)
with libfsdp.Backend("cpu", rank=world.rank) as backend, \
     libfsdp.Runtime(backend, world, weight_decay=0.0) as rt:
    rt.register_unit("fit", [("w", (1000,))])
    rt.finalize()
    for step in range(10 ** 9):
        rt.pre_forward(0)
        rt.post_forward(0)
        v = rt.pre_backward(0)
        v.grad(0)[...] += 1.0
        rt.post_backward(0)
        rt.finish_backward()
        rt.step(lr=0.01)
        if step == 0:
            open(os.path.join(sys.argv[1], "pid%d" % world.rank), "w").write(str(os.getpid()))
'''


def main():
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("skipped: python3-numpy is not installed")
        return 77
    mpiexec = sys.argv[1] if len(sys.argv) > 1 else "mpirun"
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "trainer.py")
        open(script, "w").write(TRAINER)
        job = subprocess.Popen(
            [mpiexec, "-np", "2", "--oversubscribe", "--allow-run-as-root", "--mca", "btl",
             "self,vader", sys.executable, script, tmp],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pid_file = os.path.join(tmp, "pid1")
        deadline = time.time() + 60
        while not os.path.exists(pid_file) and job.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if not os.path.exists(pid_file):
            job.kill()
            print(job.communicate()[0])
            print("FAILED: the job did not start training")
            return 1
        time.sleep(0.5)
        pid = int(open(pid_file).read())
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        try:
            out, _ = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGCONT)
            job.kill()
            print("FAILED: the job still ran 60 s after rank 1 was stopped")
            return 1
        took = time.time() - stopped
        print(out)
        if job.returncode == 0 or "DEADLINE_EXCEEDED" not in out:
            print("FAILED: the job ended (exit %d) without a DEADLINE_EXCEEDED error"
                  % job.returncode)
            return 1
        print("ok: rank 1 stopped; the job ended %.1f s later (timeout 3 s), exit %d, with "
              "DEADLINE_EXCEEDED" % (took, job.returncode))
        return 0


if __name__ == "__main__":
    sys.exit(main())
