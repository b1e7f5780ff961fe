"""What an answer's text costs a token: the whole answer decoded after every token (what
queries and reasoning units did) against `TextStream` (a window of a few tokens decoded a token,
the whole answer once at its end), side by side in one process on the embedded model's
tokenizer, over answers of --sizes tokens of mixed text (ASCII, accented letters, emoji).
Each is the best of --reps runs; the stream's figure includes its one whole decode at the end.

    python bench/detok.py [--sizes 64,512,2048] [--reps 3]

Last line: `RESULT detok_<n>_us_whole=<x> detok_<n>_us_stream=<x> ... detok_<largest>_x=<ratio>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé 🌍 text, and more words follow here. "


def per_token(fn, n: int, reps: int) -> float:
    """The best of `reps` runs of fn(), in microseconds per token."""
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512,2048")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from streamer.sessions.detok import INCOMPLETE, TextStream
    from streamer.sessions.models import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    sizes = [int(s) for s in args.sizes.split(",")]
    ids = tok(TEXT * (max(sizes) // 10 + 1))["input_ids"]
    assert len(ids) >= max(sizes)

    def whole(n: int) -> str:
        text = ""
        for i in range(1, n + 1):
            now = tok.decode(ids[:i], skip_special_tokens=True)
            if not now.endswith(INCOMPLETE):  # a character split across tokens waits, as it did
                text = now
        return text

    def stream(n: int) -> str:
        s = TextStream(tok)
        for token in ids[:n]:
            s.push(token)
        return s.finish()

    print(f"{'answer tokens':>14} {'whole us/token':>15} {'stream us/token':>16} {'ratio':>7}")
    out = {}
    for n in sizes:
        if stream(n) != whole(n):
            raise SystemExit(f"the streamed text of {n} tokens differs from the whole decode")
        w = per_token(lambda: whole(n), n, args.reps)
        s = per_token(lambda: stream(n), n, args.reps)
        print(f"{n:>14} {w:>15.1f} {s:>16.1f} {w / s:>6.1f}x")
        out[f"detok_{n}_us_whole"], out[f"detok_{n}_us_stream"] = w, s
    out[f"detok_{sizes[-1]}_x"] = out[f"detok_{sizes[-1]}_us_whole"] / out[f"detok_{sizes[-1]}_us_stream"]
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
