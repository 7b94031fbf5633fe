//! The operator console over real HTTP, on the real PostgreSQL and RabbitMQ:
//! sign-in takes operator tokens and nothing else, the session cookie's flags,
//! CSRF on actions, resolving an unknown with a reason (audited, the next
//! attempt planned and published), the job list paged by keyset, and owners'
//! limits set with a reason.

use onejob_test_support as common;

mod cli;
mod dead_letters;
mod job_list;
mod owners;
mod qualify;
mod resolve;
mod sign_in;
