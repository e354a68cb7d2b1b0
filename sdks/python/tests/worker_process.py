"""A worker process for test_kill.py: the SDK's sync worker whose handler
holds every job until stopped. Prints one JSON line when its streams are
open and one per job started."""

from __future__ import annotations

import json
import sys
import threading
import time

from sluice_client import ClientOptions, Job, Worker


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    options = ClientOptions.from_env().replace(fetch_wait_max_ms=25)

    def hold(job: Job) -> None:
        emit(event="started", job_id=job.job_id, attempt=job.attempt)
        job.wait_stopped(300)

    worker = Worker(options, hold, concurrency=int(sys.argv[1]), worker_id=sys.argv[2])

    def announce() -> None:
        while worker.status().streams < 1:
            time.sleep(0.02)
        emit(event="ready")

    threading.Thread(target=announce, daemon=True).start()
    worker.run()


if __name__ == "__main__":
    main()
