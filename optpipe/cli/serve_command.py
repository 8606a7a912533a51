"""`optpipe serve RUN [--stage S]`: a finished run's stages on a real Triton server (Open Inference
Protocol over HTTP and gRPC, loopback by default) until Ctrl-C; `--bench`: the load test instead,
its rows into report.json and its plot into report.html."""
from __future__ import annotations

from pathlib import Path

import click

CONCURRENCY_HELP = "comma-separated client counts of the sweep"


def _concurrencies(_ctx, _param, value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"'{value}' is not a comma-separated list of client counts (e.g. 1,2,4,8,16)") from None
    if not counts or min(counts) < 1 or max(counts) > 64:
        raise click.BadParameter(f"'{value}': each client count must be between 1 and 64")
    return counts


@click.command("serve")
@click.argument("run_dir", type=click.Path(path_type=Path), metavar="RUN")
@click.option("--stage", "stages", multiple=True, help="a finished stage to serve (repeatable; default: the Pareto frontier)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address the server binds (0.0.0.0 exposes it to the network)")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--bench", is_flag=True, help="run the load test (throughput, p50/p99 per concurrency, with and without dynamic batching) and stop")
@click.option("--concurrency", "concurrencies", default="1,2,4,8,16", show_default=True, callback=_concurrencies, help=CONCURRENCY_HELP)
@click.option("--duration", type=click.FloatRange(0.2, 60), default=2.0, show_default=True, help="--bench: seconds per point")
@click.option("--cache-dir", type=click.Path(path_type=Path), help="cache folder (default: the recipe's, $OPTPIPE_CACHE or ~/.cache/optpipe)")
def serve_command(run_dir: Path, stages: tuple[str, ...], host: str, http_port: int, grpc_port: int, bench: bool,
                  concurrencies: tuple[int, ...], duration: float, cache_dir: Path | None) -> None:
    """Serve the finished run RUN on tritonserver (Triton's python backend running each stage's model with its measured settings)."""
    from optpipe.serving.run_server import bench_run, serve_run

    if bench:
        click.echo(f"load test of {run_dir}: {len(concurrencies)} concurrencies x {duration} s per model, interleaved")
        bench_run(run_dir, stages, concurrencies, duration, cache_dir, echo=click.echo)
        click.echo(f"report: {run_dir / 'report.md'}, {run_dir / 'report.html'} (data: report.json `serving`)")
        return
    serve_run(run_dir, stages, host, http_port, grpc_port, echo=click.echo)
