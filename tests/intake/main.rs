//! Intake on the real broker: every reject reason is specific, lands in the
//! dead-letter queue with its reason, and stops nothing; a crash between commit and
//! ack is a redelivery that comes out as a `duplicate` of the same job.
//!
//! One binary, its tests by topic: what intake refuses (`rejects`), crashes and
//! redeliveries (`redelivery`), admission in batches (`batches`), and the
//! jobs a worker calls as soon as it admits them (`on_admission`).

use onejob_test_support as common;

mod batches;
mod on_admission;
mod redelivery;
mod rejects;

use std::time::Duration;

const SETTLE: Duration = Duration::from_secs(20);
