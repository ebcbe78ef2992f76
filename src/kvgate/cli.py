"""The ``kvgate`` command line: the registry of commands (each lives with its package) and the error handling.

Every command prints a human summary by default and one JSON object with ``--json``. Bad input gets a one-line
``kvgate: error: ...`` on stderr and exit status 2; no command prints a traceback for a user mistake.
Commands are imported only when used (or listed), so ``kvgate`` starts fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
from types import FrameType

import click

from kvgate import __version__
from kvgate.errors import UsageError

COMMANDS: dict[str, tuple[str, str]] = {
    # the simulator
    "sim": ("kvgate.sim.commands", "sim"),
    "paired": ("kvgate.sim.commands", "paired"),
    "arms": ("kvgate.sim.commands", "arms"),
    "calibrate": ("kvgate.calibration.command", "calibrate"),
    "demo": ("kvgate.sim.commands", "demo"),
    "sweep": ("kvgate.research.sweeps", "sweep"),
    "phase-map": ("kvgate.research.sweeps", "phase_map"),
    "escape": ("kvgate.research.sweeps", "escape"),
    "import-trace": ("kvgate.sim.trace_cli", "import_trace"),
    # the paper's experiments and analyses
    "experiment": ("kvgate.research.experiments", "experiment"),
    "reproduce": ("kvgate.research.experiments", "reproduce"),
    "report": ("kvgate.research.experiments", "report"),
    "drain": ("kvgate.research.experiments", "drain"),
    "engine-alternatives": ("kvgate.experiments.phase_map", "engine_alternatives_command"),
    "real-vllm": ("kvgate.realvllm.command", "command"),
    "real-sglang": ("kvgate.realsglang.command", "command"),
    "compare": ("kvgate.compare.command", "command"),
    # over HTTP
    "engine": ("kvgate.serve.command", "command"),
    "drive": ("kvgate.drive.command", "command"),
    "gateway": ("kvgate.gateway.command", "command"),
    "epp": ("kvgate.epp.command", "command"),
    "summary": ("kvgate.drive.runs", "command"),
    "doctor": ("kvgate.doctor", "command"),
}
"""Command name -> (module, attribute) of its click command."""


def _fail(msg: str) -> None:
    click.echo(f"kvgate: error: {msg}", err=True)
    sys.exit(2)


class _LazyGroup(click.Group):
    """The registry's commands, each loaded from its module when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        names.update(n for n, (mod, _) in COMMANDS.items() if importlib.util.find_spec(mod) is not None)
        return sorted(names)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            mod, attr = COMMANDS[name]
            if importlib.util.find_spec(mod) is None:
                return None
            cmd = getattr(importlib.import_module(mod), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="kvgate")
def cli() -> None:
    """kvgate: keep prefix-cached LLM engines serving agent sessions out of the metastable degraded regime.

    \b
    Simulate the paper's experiments on a laptop:
      kvgate demo                          Figure 1 (a burst that outlasts itself) in seconds
      kvgate sim --burst 1.5@15+5          one simulated run
      kvgate sim --replicas 4 --router round-robin ...   a fleet of engines behind one router
      kvgate paired --seeds 501-512 ...    paired runs with and without a trigger, sign test
      kvgate arms --control none,budgeter  controls side by side on identical arrivals
      kvgate reproduce                     every experiment of the paper, with pages and figures
      kvgate calibrate                     the engine profile against the paper's measurements
    \b
    Over HTTP:
      kvgate engine                        a vLLM-compatible simulated engine in scaled real time
      kvgate drive --endpoint URL          closed-loop agent sessions against any OpenAI endpoint
      kvgate gateway --upstream URL        the gateway that parks sessions against the KV budget
      kvgate epp --upstream IP:PORT ...    the same, as the endpoint picker of an Envoy (ext_proc)
      kvgate summary RUN_DIR...            the summary (and figures) of simulated or driven runs
    """


def _stop_on_sigterm() -> None:
    """SIGTERM stops a command as Ctrl-C does, so the ``finally`` blocks of the commands that start processes
    (``compare``, ``real-vllm``, ``reproduce``) stop what they started; a process forked from this one (a worker
    pool's) keeps dying of it at once. A SIGTERM the caller chose to ignore stays ignored."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    pid = os.getpid()

    def on_term(signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise _Terminated

    signal.signal(signal.SIGTERM, on_term)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, to unwind like Ctrl-C."""


def main(argv: list[str] | None = None) -> None:
    _stop_on_sigterm()
    try:
        cli.main(args=argv, prog_name="kvgate", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - click >= 8.2
        click.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(0)
    except click.ClickException as e:
        _fail(e.format_message().replace("\n", " "))
    except click.exceptions.Abort as e:  # click turns Ctrl-C (and our SIGTERM) into Abort
        _interrupted(e.__cause__) if isinstance(e.__cause__, KeyboardInterrupt) else _fail("aborted")
    except UsageError as e:
        _fail(str(e))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError) as e:
        if e.filename is None:  # (not a path of the user's: a fault, with its traceback)
            raise
        _fail(f"{e.filename}: {e.strerror or e}")
    except KeyboardInterrupt as e:
        _interrupted(e)


def _interrupted(e: KeyboardInterrupt) -> None:
    if isinstance(e, _Terminated):
        click.echo("kvgate: stopped (SIGTERM)", err=True)
        sys.exit(128 + signal.SIGTERM)
    click.echo("kvgate: interrupted", err=True)
    sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
