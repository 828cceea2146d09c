"""GET /metrics with ``--fronts 2`` (real processes): whichever front answers the scrape, the HTTP figures are
the sum over both fronts, the actor side's figures come over the wire, and a front killed with -9 takes none
of the requests it counted with it."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.test_fronts_processes import M, slot_tracker
from tests.api.test_fronts_processes import started as started  # the fixture

CLOSE = {"connection": "close"}  # a new connection per request: the kernel picks the front that accepts it


def add_requests(samples: list[Any]) -> float:
    for family in text_string_to_metric_families("".join(samples)):
        for sample in family.samples:
            if sample.name == "kvrouter_http_requests_total" and sample.labels == {
                "method": "POST",
                "route": "/add",
                "status": "201",
            }:
                return float(sample.value)
    return 0.0


def scrape(http: httpx.Client) -> tuple[float, str]:
    response = http.get("/metrics", headers=CLOSE)
    assert response.status_code == 200
    return add_requests([response.text]), response.text


def front_metric_files(service: Any) -> dict[int, list[str]]:
    """Each front's multiprocess files, found through its --process-role (front,<runtime dir>,...)."""
    found = {}
    for pid in service.children("front"):
        role = next(p for p in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if p.startswith(b"front,"))
        metrics_dir = Path(role.decode().split(",")[1]) / "metrics"
        found[pid] = sorted(p.name for p in metrics_dir.glob(f"*_{pid}.db"))
    return found


def test_every_front_answers_the_sum_of_both_fronts_requests(tmp_path: Path, started: Any) -> None:
    service = started(slot_tracker(tmp_path / "data"), tmp_path)
    with httpx.Client(base_url=service.url, timeout=30) as http:
        register = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert http.post("/register", json=register, headers=CLOSE).status_code == 201
        for i in range(40):
            add = {**M, "request_id": f"r{i}", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}
            assert http.post("/add", json=add, headers=CLOSE).status_code == 201
        files = front_metric_files(service)
        assert len(files) == 2 and all("counter_" + str(pid) + ".db" in names for pid, names in files.items()), files
        scrapes = [scrape(http) for _ in range(8)]
        assert [count for count, _ in scrapes] == [40.0] * 8
        text = scrapes[-1][1]
        assert 'kvrouter_mailbox_peak_depth{model_name="m",tenant_id="t"}' in text  # the actor side's, by wire
        assert "kvrouter_journal_last_lsn 41.0" in text

        victim = service.children("front")[0]
        os.kill(victim, signal.SIGKILL)
        assert service.wait_for(re.compile(r"front process \d is serving again")) is not None
        assert [scrape(http)[0] for _ in range(4)] == [40.0] * 4
    assert service.stop() == 0
