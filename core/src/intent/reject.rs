//! Why an intent was rejected: a stable code and the detail, as the
//! `rejected` receipt and the dead letter carry it.

/// Why an intent was rejected. The `Display` form is what the `rejected` receipt's
/// `error` and the dead letter's `x-onejob-error` header carry: a stable code, a
/// colon, and the detail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// The body exceeds the size limit.
    #[error("too_large: body is {size} bytes, at most {limit} allowed")]
    TooLarge {
        /// Body size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The body is not UTF-8.
    #[error("not_utf8: body is not valid UTF-8")]
    NotUtf8,
    /// The body is not JSON.
    #[error("invalid_json: {0}")]
    InvalidJson(String),
    /// The body is JSON, but not an object.
    #[error("not_an_object: the intent must be a JSON object")]
    NotAnObject,
    /// A field the contract does not define.
    #[error("unknown_field: {0:?} is not an intent field")]
    UnknownField(String),
    /// A gateway request's body names a field the gateway sets itself.
    #[error("unknown_field: {field:?} is not a body field over HTTP: {how}", field = .0, how = set_by(.0))]
    SetByGateway(&'static str),
    /// A field given twice, or a key given twice in one object of `input`.
    #[error("duplicate_field: {0:?} appears more than once")]
    DuplicateField(String),
    /// A number past ±(2^53 − 1) in size: canonical JSON would round it, and
    /// two different requests would have one fingerprint.
    #[error(
        "bad_number: {0} is beyond ±9007199254740991, which JSON numbers hold exactly; send it as a string"
    )]
    UnsafeNumber(String),
    /// A required field is absent.
    #[error("missing_field: {0:?} is required")]
    MissingField(&'static str),
    /// A field has the wrong JSON type.
    #[error("wrong_type: {field:?} must be {expected}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// What it must be.
        expected: &'static str,
    },
    /// A field is empty or too long.
    #[error("bad_length: {field:?} must be {min} to {max} characters, got {got}")]
    BadLength {
        /// The field.
        field: &'static str,
        /// Smallest length.
        min: usize,
        /// Largest length.
        max: usize,
        /// Length found.
        got: usize,
    },
    /// A field has a character outside its allowed set.
    #[error("bad_characters: {field:?} may only contain {allowed}")]
    BadCharacters {
        /// The field.
        field: &'static str,
        /// The allowed set.
        allowed: &'static str,
    },
    /// Postgres refused to store the intent (a data error such as a value out of
    /// range): no retry can succeed.
    #[error("unstorable: the database refused the intent: {0}")]
    Unstorable(String),
    /// `operation` is not configured.
    #[error("unknown_operation: {0:?} is not a configured operation")]
    UnknownOperation(String),
    /// The input does not fit the operation's prompt (a variable it uses is
    /// missing): no provider could be asked.
    #[error("bad_input: the input does not fit operation {operation:?}: {detail}")]
    BadInput {
        /// The operation.
        operation: String,
        /// What is missing, as the template engine says it.
        detail: String,
    },
    /// `provider` is not in the operation's route.
    #[error("provider_not_in_route: {provider:?} is not in the route of operation {operation:?}")]
    ProviderNotInRoute {
        /// The pinned provider.
        provider: String,
        /// The operation.
        operation: String,
    },
    /// The `reply_to` property names a queue receipts may not go to: only
    /// direct reply-to, a server-named queue and the queues the configuration
    /// allows.
    #[error(
        "reply_to_refused: {0:?} is neither direct reply-to (amq.rabbitmq.reply-to), a server-named queue (amq.gen-…) nor a queue in worker.reply_queues"
    )]
    ReplyToRefused(String),
    /// The job's reservation (its prompt's tokens plus its operation's
    /// `max_tokens`) does not fit in what the owner's `daily_tokens` leaves
    /// once its spend over the last 24 hours and its reservations are taken
    /// off: no new job until enough of them end or leave the window.
    #[error(
        "budget_exceeded: owner {owner:?} spent {spent} tokens over the last 24 hours and holds {reserved} reserved, its budget is {budget}; this job would reserve {need}; retry after {retry_after} s"
    )]
    BudgetExceeded {
        /// The owner.
        owner: String,
        /// What it spent over the window.
        spent: i64,
        /// What its open attempts hold reserved.
        reserved: i64,
        /// What this job's attempt would reserve.
        need: i64,
        /// Its `daily_tokens`.
        budget: i64,
        /// Seconds until room may free up: a second while only reservations
        /// stand in the way, else until its oldest spend leaves the window.
        retry_after: u64,
    },
}

impl RejectReason {
    /// The seconds a `budget_exceeded` error (as a receipt carries it) says to
    /// wait; `None` for any other error.
    pub fn budget_retry_after(error: &str) -> Option<u64> {
        let rest = error.strip_prefix("budget_exceeded:")?;
        let (_, tail) = rest.rsplit_once("retry after ")?;
        tail.strip_suffix(" s")?.parse().ok()
    }
}

/// Where the gateway takes a field from instead of the body.
fn set_by(field: &str) -> &'static str {
    match field {
        "owner_id" => "the owner is the bearer token's",
        _ => "the key is the Idempotency-Key header",
    }
}
