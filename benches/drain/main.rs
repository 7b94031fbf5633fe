//! The drain benchmark: a preloaded backlog drained by one `onejob-worker`
//! process, against pgbench running onejob's own per-job SQL in the same run.
//! See [`run`] for what it measures and how.
//!
//! `scripts/bench-drain [--n N] [--latency-seconds S] [--latency-load L] [--out DIR]`, which builds
//! the release binaries first. It prints progress, a table with every target
//! (met or not), and writes `drain.json` and `drain.md` into `--out`
//! (default `target/bench`). It asserts nothing.

use onejob_test_support::drain as run;

fn usage() -> ! {
    eprintln!(
        "usage: drain [--n N] [--latency-seconds S] [--pgbench-seconds S] [--out DIR] [--smoke]\n\
         \n  --n N                distinct intents in the backlog (default 20000); 25% more are duplicates\n\
         \x20 --latency-seconds S   length of the open-loop latency phase (default 20)\n\
         \x20 --latency-load L      its rate as a share of the drain rate (default 0.5, the target's)\n\
         \x20 --pgbench-seconds S   length of the pgbench baseline (default 15)\n\
         \x20 --out DIR             where drain.json and drain.md go (default target/bench)\n\
         \x20 --smoke               a run of a few seconds (N 300), as CI runs it"
    );
    std::process::exit(2)
}

fn main() {
    let mut options = run::Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("drain: {name} needs a value");
                usage()
            })
        };
        let number = |name: &str, v: String| -> usize {
            v.parse().unwrap_or_else(|_| {
                eprintln!("drain: {name} wants a whole number, not {v:?}");
                usage()
            })
        };
        match arg.as_str() {
            // cargo bench passes --bench to every benchmark.
            "--bench" => {}
            "--smoke" => options = run::Options::smoke(),
            "--n" => options.n = number("--n", value("--n")),
            "--latency-seconds" => {
                options.latency_seconds = number(&arg, value(&arg)) as u64;
            }
            "--latency-load" => {
                let v = value(&arg);
                options.latency_load = v
                    .parse::<f64>()
                    .ok()
                    .filter(|l| *l > 0.0 && *l <= 2.0)
                    .unwrap_or_else(|| {
                        eprintln!("drain: --latency-load wants a share of the drain rate in (0, 2], not {v:?}");
                        usage()
                    });
            }
            "--pgbench-seconds" => {
                options.pgbench_seconds = number(&arg, value(&arg)) as u64;
            }
            "--out" => options.out = value("--out").into(),
            "-h" | "--help" => usage(),
            other => {
                eprintln!("drain: unknown argument {other:?}");
                usage()
            }
        }
    }
    if options.n == 0 {
        eprintln!("drain: --n must be at least 1");
        usage()
    }
    run::run_and_report(
        run::drain(&options),
        |r| r.markdown(),
        |r, out| r.write(out),
        &options.out,
    );
}
