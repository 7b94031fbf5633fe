//! What follows one definite failure: the route rule with this
//! configuration, over the providers eligible for the failed operation, and
//! the backoff before the same provider is tried again. Pure: who is eligible
//! is loaded by the caller (`crate::shared::planner`), so the plan is
//! unit-tested without a database.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

use crate::domain::JobId;
use crate::policy::route::{GiveUp, next_provider};
use crate::settings::config::Config;

/// A job whose attempt just failed definitely, for the caller to plan what follows.
#[derive(Clone, Debug)]
pub struct FailedJob {
    /// The job.
    pub job_id: JobId,
    /// Its operation.
    pub operation: String,
    /// The provider that failed.
    pub failed_provider: String,
    /// Attempts made so far, the failed one included.
    pub attempts_made: u32,
    /// The failure.
    pub error: String,
    /// Whether another attempt may follow at all.
    pub retryable: bool,
    /// The failed provider's `Retry-After`, if it sent one.
    pub retry_after: Option<Duration>,
}

/// What follows a definite failure.
#[derive(Clone, Debug, PartialEq)]
pub enum NextStep {
    /// Another attempt on `provider`, after `delay`.
    Retry {
        /// The provider.
        provider: String,
        /// The backoff before it is published.
        delay: Duration,
    },
    /// No more attempts: the job fails with `error`.
    GiveUp {
        /// The job's error.
        error: String,
    },
}

/// Plans what follows definite failures, with the eligible providers of some
/// operations loaded once.
#[derive(Debug)]
pub struct Planner<'a> {
    config: &'a Config,
    eligible: HashMap<String, HashSet<String>>,
}

impl<'a> Planner<'a> {
    /// A planner over `eligible`: operation → the providers that may take its
    /// attempts (the route's first, and those qualified for its contract).
    pub fn new(config: &'a Config, eligible: HashMap<String, HashSet<String>>) -> Planner<'a> {
        Planner { config, eligible }
    }

    /// A planner that knows of no eligible provider: for settlements that plan
    /// nothing (successes, unknowns).
    pub fn unqualified(config: &'a Config) -> Planner<'a> {
        Planner {
            config,
            eligible: HashMap::new(),
        }
    }

    /// Whether `provider` may take an attempt (or a hedge) of `operation`.
    pub fn is_eligible(&self, operation: &str, provider: &str) -> bool {
        self.eligible
            .get(operation)
            .is_some_and(|e| e.contains(provider))
    }

    /// The provider a hedge of `operation` goes to while `current` is silent:
    /// the route rule's next eligible provider other than `current`, or none
    /// when there is no other or `attempts_made` spent the attempts.
    pub fn hedge_target(
        &self,
        operation: &str,
        current: &str,
        attempts_made: u32,
    ) -> Option<&'a str> {
        let op = self.config.operations.get(operation)?;
        next_provider(
            &op.route,
            |p| p != current && self.is_eligible(operation, p),
            current,
            attempts_made,
            op.max_attempts,
        )
        .ok()
    }

    /// What follows `failed`.
    pub fn plan(&self, failed: &FailedJob) -> NextStep {
        let none = HashSet::new();
        let eligible = self.eligible.get(&failed.operation).unwrap_or(&none);
        plan_next(self.config, eligible, failed)
    }
}

/// The contract's route rule with this configuration: the next provider after
/// the one that failed, among the `eligible` ones (the route's first provider and
/// those qualified for the operation's current contract). Failing over to another
/// provider happens at once; trying the same provider again waits for the backoff,
/// or for its `Retry-After` if that is longer.
pub fn plan_next(config: &Config, eligible: &HashSet<String>, failed: &FailedJob) -> NextStep {
    if !failed.retryable {
        return NextStep::GiveUp {
            error: failed.error.clone(),
        };
    }
    let Some(operation) = config.operations.get(&failed.operation) else {
        return NextStep::GiveUp {
            error: format!(
                "unknown_operation: {:?} is no longer configured; last error: {}",
                failed.operation, failed.error
            ),
        };
    };
    match next_provider(
        &operation.route,
        |p| eligible.contains(p),
        &failed.failed_provider,
        failed.attempts_made,
        operation.max_attempts,
    ) {
        Ok(provider) if provider != failed.failed_provider => NextStep::Retry {
            provider: provider.to_owned(),
            delay: Duration::ZERO,
        },
        Ok(provider) => NextStep::Retry {
            provider: provider.to_owned(),
            delay: backoff(config, failed.attempts_made)
                .max(failed.retry_after.unwrap_or_default()),
        },
        Err(GiveUp::AttemptsSpent { .. }) => NextStep::GiveUp {
            error: failed.error.clone(),
        },
        Err(give_up @ GiveUp::NoEligibleProvider) => NextStep::GiveUp {
            error: format!("{give_up}; last error: {}", failed.error),
        },
    }
}

/// The delay before the attempt after `attempts_made` attempts: exponential from
/// `retry_backoff`, capped at `retry_backoff_max`, with jitter.
pub fn backoff(config: &Config, attempts_made: u32) -> Duration {
    let w = &config.worker;
    ExponentialBuilder::default()
        .with_min_delay(w.retry_backoff)
        .with_max_delay(w.retry_backoff_max)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(attempts_made.saturating_sub(1) as usize)
        .unwrap_or(w.retry_backoff_max)
        .min(w.retry_backoff_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three providers in route order, retry backoff 1s doubling to 8s.
    fn config() -> Config {
        let provider = |name: &str| {
            format!(
                "[providers.{name}]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\n"
            )
        };
        let text = format!(
            "[worker]\nretry_backoff = \"1s\"\nretry_backoff_max = \"8s\"\n{}{}{}\n\
             [operations.op]\nsystem = \"s\"\nprompt = \"p\"\noutput_schema = {{ type = \"object\" }}\n\
             route = [\"a\", \"b\", \"c\"]\nmax_attempts = 4\n",
            provider("a"),
            provider("b"),
            provider("c")
        );
        Config::parse(&text, "test").unwrap()
    }

    fn failed(provider: &str, made: u32) -> FailedJob {
        FailedJob {
            job_id: JobId::new(),
            operation: "op".into(),
            failed_provider: provider.into(),
            attempts_made: made,
            error: "provider_error: HTTP 500".into(),
            retryable: true,
            retry_after: None,
        }
    }

    fn eligible(names: &[&str]) -> HashSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn failover_goes_to_the_next_eligible_provider_at_once() {
        let c = config();
        let all = eligible(&["a", "b", "c"]);
        assert_eq!(
            plan_next(&c, &all, &failed("a", 1)),
            NextStep::Retry {
                provider: "b".into(),
                delay: Duration::ZERO
            }
        );
        // An unqualified provider is skipped.
        assert_eq!(
            plan_next(&c, &eligible(&["a", "c"]), &failed("a", 1)),
            NextStep::Retry {
                provider: "c".into(),
                delay: Duration::ZERO
            }
        );
        // Past the end of the route it wraps around to the first.
        assert_eq!(
            plan_next(&c, &all, &failed("c", 2)),
            NextStep::Retry {
                provider: "a".into(),
                delay: Duration::ZERO
            }
        );
    }

    #[test]
    fn the_same_provider_again_waits_its_backoff_or_its_retry_after() {
        let c = config();
        let only_a = eligible(&["a"]);
        let NextStep::Retry { provider, delay } = plan_next(&c, &only_a, &failed("a", 1)) else {
            panic!("a retry");
        };
        assert_eq!(provider, "a");
        assert!(
            delay >= Duration::from_secs(1) && delay <= Duration::from_secs(8),
            "{delay:?}"
        );
        let mut asked = failed("a", 1);
        asked.retry_after = Some(Duration::from_secs(30));
        let NextStep::Retry { delay, .. } = plan_next(&c, &only_a, &asked) else {
            panic!("a retry");
        };
        assert_eq!(
            delay,
            Duration::from_secs(30),
            "the longer of backoff and Retry-After"
        );
        // The backoff never passes its cap, however many attempts were made.
        assert!(backoff(&c, 40) <= Duration::from_secs(8));
    }

    #[test]
    fn it_gives_up_when_attempts_are_spent_or_nothing_can_help() {
        let c = config();
        let all = eligible(&["a", "b", "c"]);
        assert_eq!(
            plan_next(&c, &all, &failed("b", 4)),
            NextStep::GiveUp {
                error: "provider_error: HTTP 500".into()
            }
        );
        let mut hopeless = failed("a", 1);
        hopeless.retryable = false;
        assert_eq!(
            plan_next(&c, &all, &hopeless),
            NextStep::GiveUp {
                error: "provider_error: HTTP 500".into()
            }
        );
        let NextStep::GiveUp { error } = plan_next(&c, &HashSet::new(), &failed("a", 1)) else {
            panic!("give up");
        };
        assert!(
            error.starts_with("no_qualified_provider") && error.ends_with("HTTP 500"),
            "{error}"
        );
        let mut gone = failed("a", 1);
        gone.operation = "removed".into();
        let NextStep::GiveUp { error } = plan_next(&c, &all, &gone) else {
            panic!("give up");
        };
        assert!(error.starts_with("unknown_operation"), "{error}");
    }

    #[test]
    fn a_planner_plans_with_the_eligible_set_of_the_failed_operation() {
        let c = config();
        let planner = Planner {
            config: &c,
            eligible: HashMap::from([("op".to_owned(), eligible(&["a", "c"]))]),
        };
        assert!(planner.is_eligible("op", "c") && !planner.is_eligible("op", "b"));
        assert_eq!(
            planner.plan(&failed("a", 1)),
            NextStep::Retry {
                provider: "c".into(),
                delay: Duration::ZERO
            }
        );
        assert!(matches!(
            Planner::unqualified(&c).plan(&failed("a", 1)),
            NextStep::GiveUp { .. }
        ));
    }

    #[test]
    fn a_hedge_goes_to_the_next_eligible_provider_other_than_the_silent_one() {
        let c = config();
        let planner = Planner::new(
            &c,
            HashMap::from([("op".to_owned(), eligible(&["a", "c"]))]),
        );
        assert_eq!(planner.hedge_target("op", "a", 1), Some("c"));
        // Past the route's end it wraps, never to the silent provider itself.
        assert_eq!(planner.hedge_target("op", "c", 1), Some("a"));
        let only_a = Planner::new(&c, HashMap::from([("op".to_owned(), eligible(&["a"]))]));
        assert_eq!(only_a.hedge_target("op", "a", 1), None);
        // No hedge once max_attempts (4) attempts are made, nor for an
        // operation no longer configured.
        assert_eq!(planner.hedge_target("op", "a", 4), None);
        assert_eq!(planner.hedge_target("removed", "a", 1), None);
    }
}
