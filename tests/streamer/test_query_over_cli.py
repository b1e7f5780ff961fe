"""`streamer client stream --ask` on a lagging session asks `over: "read"` and says what the
answer covers; on a session that keeps up it asks the default way. The real CLI in a subprocess
against a real server; "lagging" is made certain by the threshold (--lag-ms 0: any ack's lag is
over it; --lag-ms 1e9: none is), never by timing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from servers import ThreadedServer

TEXT = "Ada keeps the light on the island. The cat is Pepper. The boat is Marigold and sails on Tuesday. "


def stream(url: str, path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamer", "client", "stream", str(path), "--url", url,
                           "--chunk-chars", "40", "--ask", "Who keeps the light?", "--max-tokens", "4", *flags],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_client_stream_asks_over_what_was_read_when_lagging(tiny_engine, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    with ThreadedServer(tiny_engine) as server:
        lagging = stream(server.url, doc, "--lag-ms", "0")
        assert lagging.returncode == 0, lagging.stderr
        acks = [line for line in lagging.stdout.splitlines() if line.startswith("  + chunk")]
        said = re.search(r"lagging: answered over (\d+) inputs; (\d+) still being read", lagging.stdout)
        assert said, lagging.stdout
        # the CLI waits for each ack before the next chunk: everything sent was read when it asked
        assert (int(said[1]), int(said[2])) == (len(acks), 0)

        keeping_up = stream(server.url, doc, "--lag-ms", "1e9", "--json")
        assert keeping_up.returncode == 0, keeping_up.stderr
        events = [json.loads(line) for line in keeping_up.stdout.splitlines()]
        answer = next(e for e in events if e["event"] == "answer")
        acks = [e for e in events if e["event"] == "ack"]
        assert (answer["over"], answer["unread_inputs"], answer["data_version"]) == ("sent", 0, len(acks))
        assert "still being read" not in keeping_up.stdout


def test_lag_ms_must_be_a_nonnegative_number(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    bad = stream("ws://127.0.0.1:9", doc, "--lag-ms", "-1")
    assert bad.returncode == 2 and "argument --lag-ms: must be 0 or more, got -1" in bad.stderr
