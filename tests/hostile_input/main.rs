//! Hostile input from outside: a provider is not trusted with where tenant
//! data goes (its redirects are never followed), and secrets pasted into URLs
//! are never printed.
//!
//! One binary, its tests by topic: providers and the mock (`providers`),
//! secrets in URLs and what the image listens on (`exposure`), the console's
//! answers and sign-ins (`console`), the audit of operator actions (`audit`),
//! and outside text in what the CLI shows (`operator_output`).

use onejob_test_support as common;

mod audit;
mod console;
mod exposure;
mod operator_output;
mod providers;
