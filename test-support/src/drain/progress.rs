//! What a benchmark prints while it runs: progress lines and bars under its
//! name, and its report at the end.

use std::path::Path;

/// Prints a progress line under the running benchmark's name.
pub fn say(what: &str) {
    eprintln!("{}: {what}", bench_name());
}

/// The running benchmark's name, for its progress lines (`growth` sets its own).
pub static BENCH: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

fn bench_name() -> &'static str {
    BENCH.get().copied().unwrap_or("drain")
}

/// Runs a benchmark on the runtime every benchmark uses (two worker threads,
/// one per core of the machine it was written for), prints its markdown report
/// and writes `NAME.json` and `NAME.md` into `out` with `write`.
pub fn run_and_report<R>(
    run: impl std::future::Future<Output = R>,
    markdown: impl Fn(&R) -> String,
    write: impl Fn(&R, &Path),
    out: &Path,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let report = runtime.block_on(run);
    println!("{}", markdown(&report));
    write(&report, out);
    println!(
        "wrote {0}/{1}.json and {0}/{1}.md",
        out.display(),
        bench_name()
    );
}

pub fn bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{}: {{msg:<28}} [{{bar:30}}] {{pos}}/{{len}} {{per_sec}} eta {{eta}}",
            bench_name()
        ))
        .expect("progress template")
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}
