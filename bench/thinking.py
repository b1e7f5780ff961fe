"""Think while reading versus read-then-think, on the embedded model.

A document is streamed into a session at a fixed rate with a question known at the start.
Every mode gets the same total reasoning budget:
  - read-then-think: no reasoning while input streams; all of it after input.end;
  - interleaved: one cache, a reasoning unit after each chunk, written between the chunks;
  - dual: the reading cache plus a thinking cache, a unit after each chunk, concurrent
    with ingest (it never delays the reading cache).
Measured: (a) delay from the first chunk sent to the first reasoning token; (b) time from
input.end to the final answer (final deliberation, then the answer); and whether the final
answers agree across modes and contain the expected keyword.

Run: python bench/thinking.py [--chunks 6] [--interval 5] [--unit 16] [--final 16]
The last line is `RESULT first_reasoning_reduction=<fraction> final_answer_reduction=<fraction>
agreement=<fraction>` (dual versus read-then-think).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402
from streamer.sessions.flash import normalize  # noqa: E402
from streamer.sessions.models import load_model  # noqa: E402
from streamer.sessions.runner import ModelRunner  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402

QUESTION = "What new part was fitted to the lamp?"
EXPECT = ("burner", "hartwell")


def chunks(n: int) -> list[str]:
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    paragraphs = [p + "\n\n" for p in text.split("\n\n") if p.strip()]
    size = -(-len(paragraphs) // n)
    return ["".join(paragraphs[i:i + size]) for i in range(0, len(paragraphs), size)]


def run_mode(engine: Engine, name: str, thinking: dict | None, pieces: list[str], interval: float) -> dict:
    first_token = threading.Event()
    final_done = threading.Event()
    marks: dict = {}

    def listener(event: str, payload: dict) -> None:
        if event == "reasoning.delta" and not first_token.is_set():
            marks["first_reasoning"] = time.perf_counter()
            first_token.set()
        if event == "reasoning.done":
            marks["reasoning_tokens"] = marks.get("reasoning_tokens", 0) + payload["tokens"]
            if payload["final"]:
                final_done.set()

    sid = engine.create_session(thinking=thinking).result()["session_id"]
    engine.add_listener(sid, listener).result()
    started = time.perf_counter()
    acks = []
    for i, piece in enumerate(pieces):
        delay = started + i * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        acks.append(engine.append(sid, piece))
    for ack in acks:
        ack.result()
    delay = started + len(pieces) * interval - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    ended = time.perf_counter()
    engine.end_input(sid).result()
    if thinking:
        final_done.wait(600)
    answer = engine.query(sid, QUESTION, SamplingParams(max_tokens=32)).future.result()
    finished = time.perf_counter()
    state = engine.session_state(sid).result()
    engine.close_session(sid).result()
    return {"name": name, "first": marks.get("first_reasoning", float("nan")) - started,
            "final": finished - ended, "answer": answer.text.strip(), "context": answer.context_tokens,
            "reasoning_tokens": state["thinking"].get("thinking_tokens", 0), "units": state["thinking"].get("units", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6, help="pieces the document is streamed in")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between pieces")
    parser.add_argument("--unit", type=int, default=16, help="tokens per reasoning unit while streaming")
    parser.add_argument("--final", type=int, default=16, help="tokens of the final deliberation (dual, interleaved)")
    args = parser.parse_args()
    lm = load_model("embedded")
    runner = ModelRunner(lm.model, lm.tokenizer, lm.name)
    pieces = chunks(args.chunks)
    budget = len(pieces) * args.unit + args.final
    common = {"unit_tokens": args.unit, "stop": "budget", "question": QUESTION}
    modes = [
        ("read-then-think", {"mode": "dual", **common, "every_tokens": 1 << 20, "final_tokens": budget}),
        ("interleaved", {"mode": "interleaved", **common, "final_tokens": args.final}),
        ("dual", {"mode": "dual", **common, "final_tokens": args.final}),
        ("off (no reasoning)", None),
    ]
    engine = Engine(runner, EngineLimits()).start()
    try:
        engine.query(engine.create_session().result()["session_id"], "warm up", SamplingParams(max_tokens=2)).future.result()
        results = [run_mode(engine, name, cfg, pieces, args.interval) for name, cfg in modes]
    finally:
        engine.stop()

    print(f"\nmodel {lm.name}; {len(pieces)} pieces, one every {args.interval:.1f} s; reasoning budget "
          f"{budget} tokens per mode; question: {QUESTION}")
    print("\n| mode | first reasoning token after first chunk (s) | input.end -> final answer (s) | "
          "reasoning tokens written | answer |")
    print("|---|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['name']} | {r['first']:.2f} | {r['final']:.2f} | {r['reasoning_tokens']} | {r['answer'][:70]!r} |")
    base = results[0]
    dual = results[2]
    first_red = 1 - dual["first"] / base["first"]
    final_red = 1 - dual["final"] / base["final"]
    inter = results[1]
    print(f"\ndual vs read-then-think: first reasoning {first_red:.0%} sooner (target >= 80%), "
          f"final answer {final_red:.0%} sooner (target >= 60%)")
    print(f"interleaved vs read-then-think: first reasoning {1 - inter['first'] / base['first']:.0%} sooner, "
          f"final answer {1 - inter['final'] / base['final']:.0%} sooner")
    answers = {r["name"]: normalize(r["answer"]) for r in results[:3]}
    agree = sum(answers["dual"] == a for a in answers.values()) - 1
    agreement = agree / 2
    correct = {r["name"]: any(k in r["answer"].lower() for k in EXPECT) for r in results}
    print(f"final answers: dual agrees with {agree} of the 2 other reasoning modes; "
          f"contains {'/'.join(EXPECT)}: {correct}")
    print(f"RESULT first_reasoning_reduction={first_red:.2f} final_answer_reduction={final_red:.2f} "
          f"agreement={agreement:.2f}")


if __name__ == "__main__":
    main()
