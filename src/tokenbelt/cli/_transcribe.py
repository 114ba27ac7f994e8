"""``tokenbelt transcribe FILE``: speech to text here, printed as it is decoded.

Each segment's text is printed the moment the model decodes it (with its times under
``--timestamps``). Ctrl-C stops the model: the stop reaches the speech worker at once
and lands before its next native call (one 30 s window at most); the line on stderr
says when the model let go.
"""

from __future__ import annotations

import argparse
import sys

from ._common import Parser, fail

DEFAULT_SPEECH_ALIAS = "whisper-tiny-en"


def add_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    p = sub.add_parser(
        "transcribe",
        help="speech to text: print an audio file's words as they are decoded",
        description="Transcribe an audio file (WAV, MP3, FLAC, Ogg, WebM) with a local "
        "Whisper model; Ctrl-C stops the model.",
    )
    p.add_argument("file", metavar="FILE", help="the audio file")
    p.add_argument(
        "--model",
        default=DEFAULT_SPEECH_ALIAS,
        help="a speech model alias or a CTranslate2 Whisper folder "
        f"(default {DEFAULT_SPEECH_ALIAS})",
    )
    p.add_argument("--language", help="the speech's language (ISO 639-1; default: the model's)")
    p.add_argument("--prompt", help="text the model continues from (names, spelling)")
    p.add_argument("--timestamps", action="store_true", help="print each segment's start and end")
    p.add_argument(
        "--trace", action="store_true", help="print the request's trace (JSON) on stderr"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..belt import EndReason
    from ..runtime import Runtime

    if not Path(args.file).is_file():
        fail(f"file not found: {args.file}")
    with Runtime(keep_alive=None) as runtime:
        model = runtime.load(args.model, lazy=True)  # bad audio is refused before a load
        stream = model.transcription(args.file, language=args.language, prompt=args.prompt)
        first = True
        try:
            for segment in stream:
                text = segment.text.lstrip() if first or args.timestamps else segment.text
                first = False
                if args.timestamps:
                    print(f"[{segment.start:7.2f} -> {segment.end:7.2f}] {text}", flush=True)
                else:
                    print(text, end="", flush=True)
        except KeyboardInterrupt:
            stream.cancel(EndReason.USER_CANCEL)
            stream.wait_released(60)
            lag = stream.trace.cancel_to_release
            said = f"; the model let go {lag * 1000:.0f} ms later" if lag is not None else ""
            print(f"\ntokenbelt: stopped{said}", file=sys.stderr)
            return 130
        stream.wait_released(60)
        if not args.timestamps:
            print()
        if args.trace:
            print(json.dumps(stream.trace.to_dict()), file=sys.stderr)
        reason = stream.end_reason
        if reason is not EndReason.STOP:
            print(f"tokenbelt: the transcription ended with {reason}", file=sys.stderr)
            return 1
    return 0
