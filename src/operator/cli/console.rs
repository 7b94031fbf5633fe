//! `onejob console`: serve the operator console until interrupted.

use std::sync::Arc;

use clap::Args;

use super::{Connections, Failure, Outcome, store};

#[derive(Args, Debug)]
pub(super) struct ConsoleArgs {
    /// The address to listen on. Put it behind TLS (and --secure-cookies) when
    /// it is reachable beyond this machine.
    #[arg(long, default_value = crate::operator::console::DEFAULT_LISTEN)]
    listen: std::net::SocketAddr,
    /// Mark the session cookie Secure (the console is served over TLS). A
    /// request with `X-Forwarded-Proto: https` gets it anyway.
    #[arg(long)]
    secure_cookies: bool,
    /// How long a sign-in lasts.
    #[arg(long, default_value = "8h", value_parser = humantime::parse_duration)]
    session_ttl: std::time::Duration,
    /// Sign-in attempts one client address may make a minute; past it, 429.
    /// Behind a proxy every client shares its address: raise it there.
    #[arg(long, default_value_t = 10)]
    sign_ins_per_minute: u32,
}

/// `onejob console`: serves until interrupted (Ctrl-C or SIGTERM).
pub(super) async fn run(c: &Connections, args: ConsoleArgs) -> Outcome {
    let config = Arc::new(c.load_config()?);
    let store = store(c, &config).await?;
    let listener = crate::operator::console::bind(args.listen)
        .await
        .map_err(Failure)?;
    let options = crate::operator::console::Options {
        amqp_url: c.amqp_url.clone(),
        secure_cookies: args.secure_cookies,
        session_ttl: args.session_ttl,
        sign_ins_per_minute: args.sign_ins_per_minute,
        ..crate::operator::console::Options::default()
    };
    let addr = listener.local_addr().unwrap_or(args.listen);
    eprintln!("onejob console listening on http://{addr}/ (sign in with an operator token)");
    let console = crate::operator::console::Console::new(store, config, options);
    crate::operator::console::serve(listener, console, crate::edges::shutdown::wait_for_signal())
        .await
        .map_err(|e| Failure(format!("the console stopped: {e}")))?;
    Ok(())
}
