//! The failover benchmark: what a highly available PostgreSQL (Patroni,
//! etcd and HAProxy, by `scripts/pg-ha`) costs onejob against one server,
//! what a crash of its primary does to the intents in flight, and what
//! asynchronous replication loses. See `onejob_test_support::failover`.
//!
//! `scripts/bench-failover [--n N] [--latency-seconds S] [--failover-seconds S] [--loss-n N] [--out DIR] [--smoke]`,
//! which builds the release binaries first. It prints progress and tables,
//! and writes `failover.json` and `failover.md` into `--out` (default
//! `target/bench`). It asserts nothing.

use onejob_test_support::drain;
use onejob_test_support::failover as run;

fn usage() -> ! {
    eprintln!(
        "usage: failover [--n N] [--latency-seconds S] [--failover-seconds S] [--loss-n N] [--out DIR] [--smoke]\n\
         \n  --n N                  distinct intents in each drain's backlog (default 10000)\n\
         \x20 --latency-seconds S    each site's latency phase at 100 intents/s (default 15)\n\
         \x20 --failover-seconds S   the open loop the primary crashes in, a quarter of the way (default 40)\n\
         \x20 --loss-n N             intents streamed through the asynchronous cluster's crash (default 20000)\n\
         \x20 --out DIR              where failover.json and failover.md go (default target/bench)\n\
         \x20 --smoke                a run of a few minutes with small numbers"
    );
    std::process::exit(2)
}

fn main() {
    let _ = drain::BENCH.set("failover");
    let mut options = run::Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next().unwrap_or_else(|| {
                eprintln!("failover: {arg} needs a value");
                usage()
            })
        };
        let number = |v: String| -> usize {
            v.parse().ok().filter(|n| *n > 0).unwrap_or_else(|| {
                eprintln!("failover: {arg} wants a whole number above 0, not {v:?}");
                usage()
            })
        };
        match arg.as_str() {
            // cargo bench passes --bench to every benchmark.
            "--bench" => {}
            "--smoke" => options = run::Options::smoke(),
            "--n" => options.n = number(value()),
            "--latency-seconds" => options.latency_seconds = number(value()) as u64,
            "--failover-seconds" => options.failover_seconds = number(value()) as u64,
            "--loss-n" => options.loss_n = number(value()),
            "--out" => options.out = value().into(),
            "-h" | "--help" => usage(),
            other => {
                eprintln!("failover: unknown argument {other:?}");
                usage()
            }
        }
    }
    drain::run_and_report(
        run::run(&options),
        |r| r.markdown(),
        |r, out| r.write(out),
        &options.out,
    );
}
