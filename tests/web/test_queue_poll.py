"""The playground's server sits still while it has nothing to do (web/app.py QUEUE_POLL_S)."""
from __future__ import annotations

import time
from pathlib import Path


def _wakeups(native_id: int) -> int:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")).split()[1])


def test_the_idle_servers_event_loop_wakes_tens_not_a_thousand_times_a_second(engine_down_web):
    """Gradio's queue looks for work every 1 ms by default: ~900 wake-ups a second of the server's event loop with
    no page open (5-6% of a core on a 2-core box). Polled every 10 ms it wakes ~110 times (the progress loop's 10
    more); the bound leaves room for a slow machine either way."""
    thread = engine_down_web.demo.server.thread
    assert thread.is_alive()
    time.sleep(0.5)
    before, t0 = _wakeups(thread.native_id), time.monotonic()
    time.sleep(2.0)
    rate = (_wakeups(thread.native_id) - before) / (time.monotonic() - t0)
    assert rate < 300, f"the server's event loop woke {rate:.0f} times a second while idle"
