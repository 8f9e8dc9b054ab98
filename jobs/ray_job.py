"""A Ray Data job: Parquet files in -> batchgen.ray.Generate on an actor pool -> Parquet files out.

    python jobs/ray_job.py s3://bucket/prompts/ s3://bucket/generations/ --actors 8 -tp 1 --max-tokens 256
    python jobs/ray_job.py in/*.parquet out/ --address ray://head:10001 --model /models/llama -tp 2

INPUT: Parquet files or folders (any path Ray Data reads: local, s3://, gs://, ...; on a cluster, a
path every node sees). The rows are `batchgen run`'s input rows. OUTPUT: a folder of Parquet files, one
row per result: the input columns, then `run`'s output columns. Each actor holds one engine on
--tensor-parallel-size GPUs (none on a CPU-only cluster) and works on --max-concurrency batches at
once, so its device never waits between batches. Without --address the job starts a local Ray (or joins
the one RAY_ADDRESS names).

Exit codes: 0 done (error rows included: see the `error` column), 2 usage error, 1 any other failure.
"""
from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ray_job.py", description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="+", metavar="INPUT", help="Parquet files or folders")
    p.add_argument("output", metavar="OUTPUT", help="the folder to write Parquet files into")
    ray_opts = p.add_argument_group("Ray")
    ray_opts.add_argument("--address", default=None,
                          help="the cluster to join (auto, ray://head:10001, host:6379); default: a local Ray")
    ray_opts.add_argument("--actors", type=int, default=1, help="engine actors (each one engine); default 1")
    ray_opts.add_argument("--batch-size", type=int, default=256, help="rows per Ray batch; default 256")
    ray_opts.add_argument("--max-concurrency", type=int, default=2,
                          help="batches one actor works on at once (the next one joins while one ends); default 2")
    ray_opts.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each actor reserves; default 1")
    engine = p.add_argument_group("engine (as batchgen run's options)")
    engine.add_argument("--model", default=None, help="local HF model directory; default: the embedded model")
    engine.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                        help="GPUs per actor (one engine split over them); default 1")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sampling = p.add_argument_group("sampling (not given: the model's generation_config.json, else built-in)")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--min-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    sampling.add_argument("--n", type=int, help="samples of each prompt: n output rows")
    sampling.add_argument("--seed", type=int, help="job seed: a row without its own seed gets one from (seed, id)")
    sampling.add_argument("--generation-config", choices=("auto", "none"))
    sampling.add_argument("--response-format", type=json.loads, metavar="JSON")
    sampling.add_argument("--structured-outputs", type=json.loads, metavar="JSON")
    args = p.parse_args(argv)
    for name in ("actors", "batch_size", "max_concurrency", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


SAMPLING_FLAGS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "stop", "ignore_eos", "n", "seed",
                  "generation_config", "response_format", "structured_outputs")
ENGINE_FLAGS = ("tensor_parallel_size", "dtype", "max_num_seqs", "max_model_len", "gpu_memory_utilization")


def generate_kwargs(args: argparse.Namespace) -> dict:
    """Generate's constructor kwargs: the model, the sampling options given, the engine options."""
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    return {"model": args.model, "sampling": sampling, **{name: getattr(args, name) for name in ENGINE_FLAGS}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    from batchgen.ray import Generate

    kwargs = generate_kwargs(args)
    try:
        Generate.check_options(**kwargs)  # a bad option is a usage error here, not a failed actor later
    except ValueError as e:
        print(f"ray_job.py: error: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.address)
    gpus = args.tensor_parallel_size if ray.cluster_resources().get("GPU") else 0
    ds = ray.data.read_parquet(args.input)
    ds = ds.map_batches(
        Generate,
        fn_constructor_kwargs=kwargs,
        batch_size=args.batch_size,
        batch_format="pyarrow",  # the columns' own types, through to the output (numpy's are lossy)
        # max_tasks_in_flight_per_actor: Ray Data sends each actor enough tasks to fill max_concurrency
        compute=ray.data.ActorPoolStrategy(size=args.actors, max_tasks_in_flight_per_actor=2 * args.max_concurrency),
        max_concurrency=args.max_concurrency,
        num_gpus=gpus,
        num_cpus=args.num_cpus,
    )
    ds.write_parquet(args.output)
    print(f"ray_job.py: results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
