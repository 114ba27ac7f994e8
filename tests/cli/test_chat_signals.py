"""A Ctrl-C pressed as the chat's prompt appears is never lost (``PromptInterrupts``).

CPython's readline draws the prompt and then waits in ``select()``; a SIGINT landing in
between only trips Python's flag. With busy threads beside the prompt (the chat has the
runtime's), about half of such Ctrl-Cs were ignored until the next key. The program below
is the chat's prompt loop in miniature, with the real ``PromptInterrupts``, in a real pty.
"""

from __future__ import annotations

import sys
import textwrap

import pexpect

PROGRAM = textwrap.dedent(
    """
    import readline, sys, threading
    from tokenbelt.cli._chat_signals import PromptInterrupts

    def spin():
        while True:
            pass

    for _ in range(2):
        threading.Thread(target=spin, daemon=True).start()
    interrupts = PromptInterrupts()
    interrupts.install()
    while True:
        try:
            with interrupts.prompting():
                input("you> ")
        except KeyboardInterrupt:
            print("interrupted")
    """
)
TRIES = 30
#: a lost Ctrl-C is never answered (until the next key); an answered one may come late on
#: a loaded machine: the two spinning threads and the test run's other workers share its cores
ANSWER_S = 5.0


def test_every_ctrl_c_pressed_as_the_prompt_appears_is_answered() -> None:
    child = pexpect.spawn(sys.executable, ["-c", PROGRAM], encoding="utf-8", timeout=ANSWER_S)
    child.delaybeforesend = 0  # press Ctrl-C the moment the prompt is drawn
    lost = 0
    try:
        for _ in range(TRIES):
            child.expect_exact("you> ", timeout=10)
            child.sendintr()
            if child.expect_exact(["interrupted", pexpect.TIMEOUT]) == 1:
                lost += 1
                child.sendintr()  # a second press, so the next round starts at a prompt
                child.expect_exact("interrupted")
    finally:
        child.terminate(force=True)
    assert lost == 0, (
        f"{lost} of {TRIES} Ctrl-Cs at the prompt were not answered within {ANSWER_S} s"
    )
