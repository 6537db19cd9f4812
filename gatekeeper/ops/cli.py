"""The ``gatekeeper`` command line: the drill, one-off decisions, and (later) operations.

Settings are read here, at the edge, from the environment, ``.env`` and the TOML file
(``--config`` or ``GATEKEEPER_CONFIG_FILE``). Exit codes: 0 success, 1 the command could not
do its work and says why (a ``replay --once`` pass that did not hand on all it took, say), 2 bad
usage or settings.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from gatekeeper.core.dwell import GateInputs, decide
from gatekeeper.lines import flush as flush_lines
from gatekeeper.ops.context import format_number, settings_of
from gatekeeper.ops.dead_letter import dead_letter
from gatekeeper.ops.demo import demo
from gatekeeper.ops.drill import dwell_table_lines, run_ledger_drill, write_ledger
from gatekeeper.ops.flag_commands import flags, init
from gatekeeper.ops.metrics import metrics
from gatekeeper.ops.oncall import ledger, replay, sweep
from gatekeeper.ops.report import report
from gatekeeper.ops.simulate import simulate
from gatekeeper.ops.status import status
from gatekeeper.ops.tune import tune

__all__ = ["CONFIG_OPTION", "main"]

DEFAULT_LEDGER_FILE = Path(tempfile.gettempdir()) / "retry-tax-ledger.json"
"""Where ``gatekeeper drill`` writes its JSON ledger unless ``--out`` says otherwise."""


CONFIG_OPTION = click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML settings file (default: $GATEKEEPER_CONFIG_FILE, else config/gatekeeper.toml).",
)
"""``--config``, on ``gatekeeper`` and on ``celery ... gatekeeper``."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@CONFIG_OPTION
@click.option(
    "-A", "--app", "app", default=None,
    help="A Celery app (proj.celery:app) whose config (gatekeeper_* keys, broker_url) is read.",
)  # fmt: skip
@click.pass_context
def main(ctx: click.Context, config: Path | None, app: str | None) -> None:
    """Deadline-aware admission control for Celery."""
    ctx.call_on_close(flush_lines)  # a command's log lines before it returns, not at exit
    obj = ctx.ensure_object(dict)
    obj["config"] = config
    obj.setdefault("app", app)


@main.command()
@click.option(
    "--seed", type=int, default=None, help="Seed of the ledger drill (default: [drill].seed)."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_LEDGER_FILE,
    show_default=True,
    help="Where to write the JSON ledger.",
)
@click.pass_context
def drill(ctx: click.Context, seed: int | None, out: Path) -> None:
    """Run both local drills: the dwell-gate table, then the retry-tax ledger."""
    cfg = settings_of(ctx).drill
    if seed is not None:
        cfg = cfg.model_copy(update={"seed": seed})
    for line in dwell_table_lines():
        click.echo(line)
    result = run_ledger_drill(cfg)
    for _, summary in result.summaries:
        click.echo(summary.line())
    try:
        written = write_ledger(result, out)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {out}: {exc.strerror}", param_hint="--out") from exc
    click.echo(f"wrote {written}")


@main.command(name="decide")
@click.option(
    "--queue-age-s", type=float, required=True, help="Age of the free queue's oldest task."
)
@click.option("--expected-service-s", type=float, required=True, help="Declared service time.")
@click.option(
    "--retry-tax-s", type=float, default=0.0, show_default=True, help="retries_left x service."
)
@click.option("--deadline-slack-s", type=float, required=True, help="Deadline minus now.")
@click.option(
    "--max-queue-age-s", type=float, default=None, help="Queue-age cap (default: from settings)."
)
@click.pass_context
def decide_command(
    ctx: click.Context,
    queue_age_s: float,
    expected_service_s: float,
    retry_tax_s: float,
    deadline_slack_s: float,
    max_queue_age_s: float | None,
) -> None:
    """Print what the dwell gate would decide for these inputs."""
    cap = settings_of(ctx).max_queue_age_s if max_queue_age_s is None else max_queue_age_s
    inputs = GateInputs(queue_age_s, expected_service_s, retry_tax_s, deadline_slack_s, cap)
    result = decide(inputs)
    line = (
        f"dwell={format_number(result.dwell_s)} slack={format_number(deadline_slack_s)} "
        f"decision={result.decision.value} reason={result.reason.value}"
    )
    if result.field is not None:
        line += f" field={result.field}"
    click.echo(line)


for _command in (dead_letter, demo, flags, init, ledger, metrics, replay, report, status, sweep):
    main.add_command(_command)
main.add_command(simulate)
main.add_command(tune)
