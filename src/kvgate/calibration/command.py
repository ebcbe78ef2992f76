"""``kvgate calibrate``: the simulated engine beside the paper's measurements (:mod:`kvgate.calibration.paper`), or
a live engine measured (:mod:`kvgate.calibration.measure`) and its cost-model profile fitted
(:mod:`kvgate.calibration.fit`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvgate.errors import UsageError
from kvgate.options import FINITE


@click.command()
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quick", is_flag=True, help="Shorter runs for the load-dependent targets (fewer measurements "
              "with --endpoint).")
@click.option("--endpoint", default=None, metavar="URL",
              help="Measure this live vLLM-compatible server instead and fit a profile for it.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --endpoint: write the fitted profile here (usable as --profile FILE).")
@click.option("--name", default=None, help="With --endpoint: the fitted profile's name [default: from the model].")
@click.option("--note", default="", help="With --endpoint: a note stored in the profile (machine, server flags).")
@click.option("--time-scale", type=FINITE, default=1.0, show_default=True,
              help="With --endpoint: virtual seconds per real second of the server (kvgate engine's).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="With --endpoint: the server's step budget when /server_info does not tell it.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="With --endpoint: the server's batch limit when /server_info does not tell it.")
@click.option("--api-key", envvar="KVGATE_API_KEY", default=None, help="Bearer token [env: KVGATE_API_KEY].")
@click.option("--fit-mixed", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Fit the mixed step's two constants jointly (a grid on the reserved seeds) and write the grid "
              "and its minimum to DIR.")
def calibrate(
    profile: str, as_json: bool, quick: bool, endpoint: str | None, out: Path | None, name: str | None, note: str,
    time_scale: float, max_num_batched_tokens: int | None, max_num_seqs: int | None, api_key: str | None,
    fit_mixed: Path | None,
) -> None:
    """Micro-experiments on the simulated engine beside the paper's measurements (ok/off per target).

    \b
    With --endpoint URL: measure a live vLLM (cold and incremental prefill, decode by batch size, a
    c(L) load of all-miss turns), fit the cost model's constants and write a profile file:
      kvgate calibrate --endpoint http://127.0.0.1:8000 --out my-engine.json
      kvgate sim --profile my-engine.json --block-size 128 ...
    """
    if fit_mixed is not None:
        if endpoint is not None:
            raise UsageError("--fit-mixed fits the simulated engine on the paper's figures, not a live --endpoint")
        _fit_mixed(profile, fit_mixed, as_json)
        return
    if endpoint is not None:
        from kvgate.calibration.fit import format_report
        from kvgate.calibration.measure import run
        from kvgate.engine.costmodel import save_profile

        prof, cal = run(
            endpoint, name=name, quick=quick, time_scale=time_scale, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, api_key=api_key, note=note,
            progress=None if as_json else (lambda m: click.echo(m, err=True)),
        )
        if out is not None:
            save_profile(prof, out, cal)
        if as_json:
            from kvgate.engine.costmodel import profile_to_dict

            click.echo(json.dumps(profile_to_dict(prof, cal), sort_keys=True))
            return
        click.echo(format_report(prof, cal))
        if out is not None:
            click.echo(f"profile: {out}")
        return
    if out is not None or name is not None:
        raise UsageError("--out and --name need --endpoint")
    from kvgate.calibration.paper import format_targets, run_calibration

    targets = run_calibration(profile, quick=quick, progress=not as_json)
    if as_json:
        click.echo(json.dumps({"profile": profile, "targets": targets}, sort_keys=True))
        return
    click.echo(format_targets(profile, targets))


def _fit_mixed(profile: str, out: Path, as_json: bool) -> None:
    from kvgate.calibration.mixed import fit_mixed, write_fit
    from kvgate.engine.costmodel import profile as get_profile

    get_profile(profile)

    def progress(g: dict) -> None:
        click.echo(f"factor {g['mixed_decode_factor']:g} exponent {g['mixed_share_exponent']:g}: slope "
                   f"{g['slope_ms_per_token']:.4f} capacity {g['capacity_turns_s']:.3f} J {g['objective']:.4f}",
                   err=True)

    fit = fit_mixed(profile, progress=None if as_json else progress)
    write_fit(fit, out)
    click.echo(json.dumps(fit["best"], sort_keys=True) if as_json else f"minimum: {fit['best']}\ngrid: {out}")
