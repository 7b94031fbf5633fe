//! The operator's tools: the `onejob` command ([`cli`]) and the web console
//! ([`console`]), both over the same store calls, both auditing every action
//! first; `terminal` escapes outside text for plain output, `throttle` holds a
//! client to an allowance (the console's sign-in).

pub mod cli;
pub mod console;
pub(crate) mod terminal;
pub(crate) mod throttle;
