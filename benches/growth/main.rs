//! The growth benchmark: a million ended jobs pruned while intake runs, and the
//! tables' sizes through it. See [`run`] for what it measures and how.
//!
//! `scripts/bench-growth [--n N] [--rate R] [--baseline-seconds S] [--out DIR]`,
//! which builds the release binaries first. It prints progress and tables, and
//! writes `growth.json` and `growth.md` into `--out` (default `target/bench`).
//! It asserts nothing.

use onejob_test_support::drain;
use onejob_test_support::growth as run;

fn usage() -> ! {
    eprintln!(
        "usage: growth [--n N] [--rate R] [--baseline-seconds S] [--window-seconds S] [--refills K] [--out DIR] [--smoke]\n\
         \n  --n N                  ended jobs in each of the two fills (default 1000000)\n\
         \x20 --rate R               intake, intents per second, while measuring (default 200)\n\
         \x20 --baseline-seconds S   the intake's baseline before pruning (default 60)\n\
         \x20 --window-seconds S     the pruning phase's windows (default 10)\n\
         \x20 --refills K            fills after the first, each pruned before the next (default 2)\n\
         \x20 --out DIR              where growth.json and growth.md go (default target/bench)\n\
         \x20 --smoke                a run of a minute or so (N 3000), as the smoke test runs it"
    );
    std::process::exit(2)
}

fn main() {
    let _ = drain::BENCH.set("growth");
    let mut options = run::Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next().unwrap_or_else(|| {
                eprintln!("growth: {name} needs a value");
                usage()
            })
        };
        let number = |name: &str, v: String| -> u64 {
            v.parse().ok().filter(|n| *n > 0).unwrap_or_else(|| {
                eprintln!("growth: {name} wants a whole number above 0, not {v:?}");
                usage()
            })
        };
        match arg.as_str() {
            // cargo bench passes --bench to every benchmark.
            "--bench" => {}
            "--smoke" => options = run::Options::smoke(),
            "--n" => options.n = number(&arg, value(&arg)) as usize,
            "--rate" => {
                let v = value(&arg);
                options.rate = v
                    .parse::<f64>()
                    .ok()
                    .filter(|r| *r > 0.0 && r.is_finite())
                    .unwrap_or_else(|| {
                        eprintln!("growth: --rate wants intents per second above 0, not {v:?}");
                        usage()
                    });
            }
            "--baseline-seconds" => options.baseline_seconds = number(&arg, value(&arg)),
            "--window-seconds" => options.window_seconds = number(&arg, value(&arg)),
            "--refills" => options.refills = number(&arg, value(&arg)) as usize,
            "--out" => options.out = value("--out").into(),
            "-h" | "--help" => usage(),
            other => {
                eprintln!("growth: unknown argument {other:?}");
                usage()
            }
        }
    }
    drain::run_and_report(
        run::growth(&options),
        |r| r.markdown(),
        |r, out| r.write(out),
        &options.out,
    );
}
