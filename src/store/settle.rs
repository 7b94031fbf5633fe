//! Attempts: the guarded start, and settling finished attempts (the
//! compare-and-swap, unknowns, definite failures and what follows them),
//! operators' resolutions and lost attempts.

use super::*;

impl Store {
    /// Moves queued attempts to `started` with one guarded statement and marks their
    /// jobs `running`, under a claim of its own ([`Store::claim`]). An id missing
    /// from the result was a duplicate delivery (the attempt had already left
    /// `queued`), belongs to a job that has ended, to a job blocked by an
    /// `unknown` attempt ([`Store::attempt_state`] tells which), or to a job row
    /// held under someone else's lock.
    pub async fn start(
        &self,
        provider: &str,
        ids: &[AttemptId],
        timeout: Duration,
    ) -> Result<Vec<Started>> {
        Ok(self
            .claim(provider, ids, timeout, Uuid::now_v7())
            .await?
            .started)
    }

    /// Moves queued attempts to `started` with one guarded statement and marks
    /// their jobs `running`; `token` names this claim on the rows it starts.
    ///
    /// The same claim run again returns the attempts it has already started:
    /// a claim whose commit took effect although its reply was lost (the
    /// connection broke after the server ran it) is retried with the same
    /// token and finds its attempts its own, so the calls go ahead. Without the
    /// token such attempts would look like another worker's, be dropped as
    /// duplicates, and stay `started` with no call.
    ///
    /// The jobs are locked first and their status checked under the lock, so a
    /// timeout that commits meanwhile is seen: a job that just became `unknown` is
    /// never written back to `running`, and no attempt of it starts. A job row
    /// held under someone else's lock is skipped, not waited for: its attempts
    /// come back in [`Claim::busy`], and the rest of the claim goes ahead.
    ///
    /// Attempts are found by primary key. A status test that implies the
    /// predicate of the partial index `attempts_one_open_per_lane` is written
    /// `(…) IS TRUE` (the same filter, which the planner cannot match to the
    /// predicate): otherwise the planner, seeing few open attempts, scans that
    /// whole index, whose entries for attempts that closed a moment ago are
    /// dead until vacuum, and under load those dead entries cost more than the
    /// rest of the statement.
    pub async fn claim(
        &self,
        provider: &str,
        ids: &[AttemptId],
        timeout: Duration,
        token: Uuid,
    ) -> Result<Claim> {
        if ids.is_empty() {
            return Ok(Claim::default());
        }
        let ids: Vec<Uuid> = ids.iter().map(|a| a.0).collect();
        let rows = self
            .retrying(|| {
                sqlx::query_as!(
                    ClaimRow,
                    r#"WITH candidates AS (
                         SELECT id, job_id FROM attempts
                         WHERE id = ANY($1) AND provider = $2
                           AND ((status = 'queued') IS TRUE
                                OR (status = 'started' AND claim = $4) IS TRUE)
                     ), claimed AS (
                         SELECT j.id FROM jobs j
                         WHERE j.id IN (SELECT job_id FROM candidates)
                           AND j.status IN ('queued', 'running')
                         ORDER BY j.id
                         FOR UPDATE SKIP LOCKED
                     ), started AS (
                         UPDATE attempts a
                         SET status = 'started', claim = $4,
                             started_at = COALESCE(a.started_at, now()),
                             deadline_at = COALESCE(a.deadline_at, now() + make_interval(secs => $3))
                         FROM claimed c
                         WHERE a.id = ANY($1) AND a.job_id = c.id AND a.provider = $2
                           AND ((a.status = 'queued') IS TRUE
                                OR (a.status = 'started' AND a.claim = $4) IS TRUE)
                         RETURNING a.id, a.job_id, a.number
                     ), running AS (
                         UPDATE jobs j SET status = 'running', updated_at = now()
                         FROM (SELECT DISTINCT job_id FROM started) s
                         WHERE j.id = s.job_id
                         RETURNING j.id, j.version, j.operation, j.input
                     )
                     SELECT s.id AS "attempt_id!: AttemptId", s.job_id AS "job_id!: JobId",
                            s.number AS "number!", r.version AS "version!",
                            r.operation AS "operation!", r.input AS "input!",
                            false AS "busy!"
                     FROM started s JOIN running r ON r.id = s.job_id
                     UNION ALL
                     -- Queued attempts of open jobs that the lock skipped.
                     SELECT c.id, c.job_id, 0, 0, '', '{}'::jsonb, true
                     FROM candidates c JOIN jobs j ON j.id = c.job_id
                     WHERE j.status IN ('queued', 'running')
                       AND c.job_id NOT IN (SELECT id FROM claimed)"#,
                    &ids,
                    provider,
                    timeout.as_secs_f64(),
                    token,
                )
                .fetch_all(&self.pool)
                .map_err(StoreError::from)
            })
            .await?;
        let mut claim = Claim::default();
        for r in rows {
            if r.busy {
                claim.busy.push(r.attempt_id);
                continue;
            }
            let input = match r.input {
                Value::Object(m) => m,
                other => return Err(corrupt(format!("job input is not an object: {other}"))),
            };
            claim.started.push(Started {
                attempt_id: r.attempt_id,
                job_id: r.job_id,
                number: r.number,
                version: r.version,
                operation: r.operation,
                input,
            });
        }
        Ok(claim)
    }

    /// Hands back what the claim `token` started: its attempts go back to
    /// `queued`, for their redelivered messages to claim again. For a claim
    /// whose caller gave up without knowing whether it took effect: an attempt
    /// it did start would otherwise stay `started` with no call, until the
    /// vanished sweep made it `unknown`. Returns how many it handed back.
    pub async fn unclaim(&self, token: Uuid) -> Result<u64> {
        self.retrying(|| async {
            let back = sqlx::query!(
                "UPDATE attempts SET status = 'queued', claim = NULL, started_at = NULL,
                     deadline_at = NULL
                 WHERE claim = $1 AND status = 'started'",
                token
            )
            .execute(&self.pool)
            .await?;
            Ok(back.rows_affected())
        })
        .await
    }

    /// Settles finished attempts in one transaction: successes race through the
    /// compare-and-swap, unknowns block their job, failures plan the next attempt
    /// with `plan`. Returns what happened to each, in input order, and the outbox
    /// rows to publish now.
    ///
    /// One settlement never costs its neighbours: the flush takes its rows with
    /// `SKIP LOCKED`, so a job or attempt row held under someone else's lock
    /// comes out as [`Settled::Busy`] while the rest settle; and when Postgres
    /// refuses the flush (its data, a lock or statement timeout, a deadlock),
    /// each is settled in a transaction of its own, the one refused coming out
    /// as [`Settled::Refused`] (its data) or [`Settled::Busy`] (contention).
    /// A flush whose connection broke runs again whole: every step of it is
    /// guarded, so a flush that had committed unseen changes nothing the second
    /// time, and its outbox rows are the relay's.
    pub async fn finalize(
        &self,
        finished: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        if finished.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let settle = |batch| {
            self.retrying_when(
                move || self.finalize_once(batch, plan),
                StoreError::is_connection_lost,
            )
        };
        match settle(finished).await {
            Err(e) if e.is_data_error() || e.is_contention() => {
                tracing::info!(error = %e, settlements = finished.len(), "Postgres refused a settlement flush; settling each apart");
            }
            other => return other,
        }
        let mut settled = Vec::with_capacity(finished.len());
        let mut publish = Vec::new();
        for one in finished.chunks(1) {
            match settle(one).await {
                Ok((outcome, rows)) => {
                    settled.extend(outcome);
                    publish.extend(rows);
                }
                Err(e) if e.is_contention() => {
                    tracing::info!(attempt_id = %one[0].attempt_id, error = %e, "a settlement met contention; it is settled again later");
                    crate::metrics::db_retry(&e.retry_code());
                    settled.push(Settled::Busy);
                }
                Err(e) if e.is_data_error() => {
                    tracing::error!(attempt_id = %one[0].attempt_id, error = %e, "Postgres refused a settlement; its neighbours were settled without it");
                    settled.push(Settled::Refused {
                        error: e.to_string(),
                    });
                }
                // The ones settled so far are committed: their redelivered
                // messages find them settled and are dropped as duplicates, and
                // the relay publishes their outbox rows.
                Err(e) => return Err(e),
            }
        }
        Ok((settled, publish))
    }

    async fn finalize_once(
        &self,
        all: &[Finished],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<Settled>, Vec<OutboxMessage>)> {
        let mut tx = self.pool.begin().await?;
        let mut settled: HashMap<AttemptId, Settled> = HashMap::new();
        let rows: Vec<(AttemptId, JobId)> = all.iter().map(|f| (f.attempt_id, f.job_id)).collect();
        let busy = take_rows(&mut tx, &rows).await?;
        let finished: Vec<&Finished> = all
            .iter()
            .filter(|f| !busy.contains(&f.attempt_id))
            .collect();
        for id in &busy {
            settled.insert(*id, Settled::Busy);
        }
        let mut drafts = Vec::new();
        let mut won = Vec::new();

        let wins: Vec<&Finished> = finished
            .iter()
            .copied()
            .filter(|f| matches!(f.verdict, Verdict::Succeeded(_)))
            .collect();
        if !wins.is_empty() {
            let successes = self.settle_successes(&mut tx, &wins).await?;
            settled.extend(successes.outcomes);
            drafts.extend(successes.events);
            won = successes.won;
        }

        let unknowns: Vec<(AttemptId, String)> = finished
            .iter()
            .filter_map(|f| match &f.verdict {
                Verdict::Unknown { error } => Some((f.attempt_id, error.clone())),
                _ => None,
            })
            .collect();
        if !unknowns.is_empty() {
            let mut marked = mark_unknown(&mut tx, &unknowns).await?;
            for (id, _) in &unknowns {
                settled.insert(*id, marked.remove(id).unwrap_or(Settled::Stale));
            }
        }

        let failures: Vec<Failure> = finished
            .iter()
            .filter_map(|f| match &f.verdict {
                Verdict::Failed {
                    error,
                    retryable,
                    retry_after,
                } => Some(Failure {
                    attempt_id: f.attempt_id,
                    error: error.clone(),
                    retryable: *retryable,
                    retry_after: *retry_after,
                    usage: f.usage.clone(),
                    request_id: f.provider_request_id.clone(),
                }),
                _ => None,
            })
            .collect();
        if !failures.is_empty() {
            let (outcomes, more) = self
                .settle_failures(
                    &mut tx,
                    &failures,
                    &[AttemptStatus::Started, AttemptStatus::Unknown],
                    plan,
                    false,
                )
                .await?;
            settled.extend(outcomes);
            drafts.extend(more);
        }

        // The won jobs' other attempts are closed by the statement that writes
        // the outbox rows: a statement after the compare-and-swap, so its fresh
        // snapshot sees a timeout that committed while the compare-and-swap
        // waited for the job, without a round trip of its own.
        let publish = self.insert_outbox_closing(&mut tx, &drafts, &won).await?;
        tx.commit().await?;
        let outcomes = all
            .iter()
            .map(|f| settled.remove(&f.attempt_id).unwrap_or(Settled::Stale))
            .collect();
        Ok((outcomes, publish))
    }

    /// The compare-and-swap. Exactly one attempt per job can move `completed_by`
    /// from NULL; every other open attempt that finishes is `discarded`, its usage
    /// kept, its result dropped whole. Every attempt's outcome is in
    /// `outcomes` (the discarded ones with their winner); the caller closes the
    /// `won` jobs' other attempts in a later statement
    /// ([`Store::insert_outbox_closing`]).
    async fn settle_successes(
        &self,
        tx: &mut PgConnection,
        wins: &[&Finished],
    ) -> Result<CasOutcomes> {
        let mut out = cas_outcomes(compare_and_swap(tx, wins).await?, &self.routes)?;
        let discarded = std::mem::take(&mut out.discarded);
        let winners = winners_of(tx, &discarded).await?;
        for (attempt, job) in discarded {
            let winner = winners.get(&job).copied().flatten();
            tracing::info!(
                job_id = %job,
                discarded_attempt = %attempt,
                winning_attempt = ?winner.map(|w| w.to_string()),
                "late result discarded: the job already has its outcome"
            );
            out.outcomes.push((attempt, Settled::Discarded { winner }));
        }
        Ok(out)
    }

    /// Definite failures: mark the attempts `failed`, then, per job, either create
    /// the next attempt (with its not-before time persisted) or fail the job.
    async fn settle_failures(
        &self,
        tx: &mut PgConnection,
        failures: &[Failure],
        from: &[AttemptStatus],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        immediate: bool,
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxDraft>)> {
        let failed = mark_failed(tx, failures, from).await?;
        if failed.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let job_ids: Vec<Uuid> = failed
            .iter()
            .map(|f| f.job_id)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let states = lock_jobs(tx, &job_ids).await?;
        let planned = plan_failures(&failed, &states, failures, plan, immediate, Utc::now())?;
        let triggered = planned.triggered.clone();
        let (drafts, failed_jobs) = self.apply_failure_plan(tx, planned).await?;
        let outcomes = failed
            .iter()
            .map(|f| {
                (
                    AttemptId(f.attempt_id),
                    Settled::Failed {
                        next: triggered.get(&f.attempt_id).copied(),
                        job_failed: failed_jobs.contains(&f.job_id),
                    },
                )
            })
            .collect();
        Ok((outcomes, drafts))
    }

    /// Writes a failure plan: jobs unblocked (their waiting attempts published
    /// again), next attempts created, jobs failed. Returns the outbox rows to
    /// write and the jobs that failed.
    async fn apply_failure_plan(
        &self,
        tx: &mut PgConnection,
        plan: FailurePlan,
    ) -> Result<(Vec<OutboxDraft>, BTreeSet<Uuid>)> {
        let FailurePlan {
            next_attempts,
            give_up,
            unblocked,
            republish,
            ..
        } = plan;
        let mut drafts: Vec<OutboxDraft> = republish
            .iter()
            .map(|(attempt, job, provider)| {
                self.routes
                    .attempt_draft(AttemptId(*attempt), JobId(*job), provider, None)
            })
            .collect();
        if !unblocked.is_empty() {
            sqlx::query!(
                "UPDATE jobs SET status = 'running', updated_at = now()
                 WHERE id = ANY($1) AND status = 'unknown'",
                &unblocked
            )
            .execute(&mut *tx)
            .await?;
        }
        insert_next_attempts(tx, &next_attempts).await?;
        for n in &next_attempts {
            drafts.push(
                self.routes
                    .attempt_draft(n.id, n.job, &n.provider, n.not_before),
            );
        }
        let mut failed_jobs = BTreeSet::new();
        if !give_up.is_empty() {
            let jobs: Vec<Uuid> = give_up.iter().map(|g| g.0).collect();
            let errors: Vec<String> = give_up.iter().map(|g| g.1.clone()).collect();
            let ended = sqlx::query_as!(
                Ended,
                r#"UPDATE jobs j
                   SET status = 'failed', error = g.error, version = j.version + 1, updated_at = now()
                   FROM unnest($1::uuid[], $2::text[]) AS g(job_id, error)
                   WHERE j.id = g.job_id AND j.status IN ('queued', 'running', 'unknown')
                   RETURNING j.id AS "job_id: JobId", j.version, j.owner_id, j.idempotency_key,
                             j.operation, j.status AS "status: JobStatus",
                             j.completed_by AS "completed_by: AttemptId", j.result, j.error"#,
                &jobs,
                &errors,
            )
            .fetch_all(&mut *tx)
            .await?;
            for ended in ended {
                failed_jobs.insert(ended.job_id.0);
                drafts.push(ended.draft(&self.routes));
            }
        }
        Ok((drafts, failed_jobs))
    }

    /// An operator's out-of-band resolution of an open attempt. `--as failed` is a
    /// definite failure (the route rule picks the next attempt, at once);
    /// `--as cancelled` ends the attempt and its job. Refused on a terminal attempt
    /// or job.
    pub async fn resolve(
        &self,
        attempt: AttemptId,
        resolution: Resolution,
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
        actor: &Actor,
    ) -> Result<Result<(Settled, Vec<OutboxMessage>), Refusal>> {
        let Some((job_id, status, job_status)) = self.attempt_state(attempt).await? else {
            return Ok(Err(Refusal::NotFound(format!("attempt {attempt}"))));
        };
        if status.is_terminal() {
            return Ok(Err(Refusal::Terminal(format!(
                "attempt {attempt} is already {status}: a terminal attempt cannot be resolved"
            ))));
        }
        if job_status.is_terminal() {
            return Ok(Err(Refusal::terminal_job(job_id, job_status)));
        }
        // The audit row's id is chosen here, once for every try: a try whose
        // commit reply was lost is found done by its row.
        let audit_id = Uuid::now_v7();
        let result = match resolution {
            Resolution::Failed => {
                self.retrying(|| async {
                    let mut tx = self.pool.begin().await?;
                    let failure = Failure {
                        attempt_id: attempt,
                        error: "resolved_failed: an operator resolved this attempt as failed"
                            .into(),
                        retryable: true,
                        retry_after: None,
                        usage: None,
                        request_id: None,
                    };
                    let (mut outcomes, drafts) = self
                        .settle_failures(
                            &mut tx,
                            &[failure],
                            &[
                                AttemptStatus::Queued,
                                AttemptStatus::Started,
                                AttemptStatus::Unknown,
                            ],
                            plan,
                            true,
                        )
                        .await?;
                    let Some((_, settled)) = outcomes.pop() else {
                        return Ok(None);
                    };
                    let next = match settled {
                        Settled::Failed { next, .. } => next,
                        _ => None,
                    };
                    let action = Action {
                        id: Some(audit_id),
                        action: "attempt.resolve_failed",
                        job: Some(job_id),
                        attempt: Some(attempt),
                        detail: serde_json::json!({ "next_attempt": next }),
                        ..Action::default()
                    };
                    audit::record(&mut tx, actor, &action).await?;
                    let publish = self.insert_outbox(&mut tx, &drafts).await?;
                    tx.commit().await?;
                    Ok(Some((settled, publish)))
                })
                .await?
            }
            Resolution::Cancelled => {
                let reason = format!(
                    "cancelled: attempt {attempt} was resolved as cancelled by an operator"
                );
                let action = Action {
                    id: Some(audit_id),
                    action: "attempt.resolve_cancelled",
                    job: Some(job_id),
                    attempt: Some(attempt),
                    ..Action::default()
                };
                self.retrying(|| self.cancel_once(job_id, Some(attempt), &reason, (actor, &action)))
                    .await?
                    .map(|publish| (Settled::Stale, publish))
            }
        };
        if let Some(done) = result {
            return Ok(Ok(done));
        }
        // Nothing changed on the last try: the attempt changed meanwhile, or an
        // earlier try committed although its reply was lost. Its audit row
        // tells which; its outbox rows are the relay's to publish.
        match self.recorded(audit_id).await? {
            Some(detail) => {
                let settled = match resolution {
                    Resolution::Failed => Settled::Failed {
                        next: serde_json::from_value(detail["next_attempt"].clone())
                            .unwrap_or_default(),
                        job_failed: false,
                    },
                    Resolution::Cancelled => Settled::Stale,
                };
                Ok(Ok((settled, Vec::new())))
            }
            None => Ok(Err(Refusal::Terminal(format!(
                "attempt {attempt} changed while it was being resolved; look again"
            )))),
        }
    }

    /// Fails attempts that are still `queued` (their message was lost for good), and
    /// plans what follows each, as for any definite failure.
    pub async fn fail_queued(
        &self,
        attempts: &[(AttemptId, String)],
        plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    ) -> Result<(Vec<(AttemptId, Settled)>, Vec<OutboxMessage>)> {
        if attempts.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        self.retrying(|| async {
            let mut tx = self.pool.begin().await?;
            let failures: Vec<Failure> = attempts
                .iter()
                .map(|(id, error)| Failure {
                    attempt_id: *id,
                    error: error.clone(),
                    retryable: true,
                    retry_after: None,
                    usage: None,
                    request_id: None,
                })
                .collect();
            let (outcomes, drafts) = self
                .settle_failures(&mut tx, &failures, &[AttemptStatus::Queued], plan, false)
                .await?;
            let publish = self.insert_outbox(&mut tx, &drafts).await?;
            tx.commit().await?;
            Ok((outcomes, publish))
        })
        .await
    }
}

/// A row of [`Store::claim`]: an attempt that left `queued`, with its job, or
/// (`busy`) a queued attempt whose job row was held.
struct ClaimRow {
    attempt_id: AttemptId,
    job_id: JobId,
    number: i32,
    version: i64,
    operation: String,
    input: Value,
    busy: bool,
}

/// How long a settlement waits for a row it did not take at its start (another
/// attempt of a job it won, say) before it gives up and is settled again
/// later. A shorter `lock_timeout` set on the role or database is kept.
const SETTLEMENT_LOCK_PATIENCE: Duration = Duration::from_secs(1);

/// Takes the settlement's rows, jobs first, with `SKIP LOCKED`: a settlement
/// never waits for a row someone else holds (an operator's open transaction, a
/// migration, another worker settling a hedge of the same job). Returns the
/// attempts whose job or attempt row was held: they are not settled now. An
/// attempt that does not exist at all is not held: its settlement finds
/// nothing to change.
///
/// The same statement caps the transaction's `lock_timeout`
/// ([`SETTLEMENT_LOCK_PATIENCE`]), so that what is left to wait for (closing a
/// won job's other attempts) fails the flush in time rather than hang it.
pub(super) async fn take_rows(
    tx: &mut PgConnection,
    rows: &[(AttemptId, JobId)],
) -> Result<BTreeSet<AttemptId>> {
    let attempts: Vec<Uuid> = rows.iter().map(|r| r.0.0).collect();
    let jobs: Vec<Uuid> = rows
        .iter()
        .map(|r| r.1.0)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let patience = i64::try_from(SETTLEMENT_LOCK_PATIENCE.as_millis()).unwrap_or(i64::MAX);
    let taken: BTreeSet<AttemptId> = sqlx::query_scalar!(
        r#"WITH patience AS (
               SELECT CASE WHEN current_setting('lock_timeout')::interval = interval '0'
                             OR current_setting('lock_timeout')::interval > make_interval(secs => $3::bigint / 1000.0)
                           THEN set_config('lock_timeout', $3::bigint::text, true) END AS lock_timeout
           ), jobs_taken AS (
               SELECT id FROM jobs WHERE id = ANY($2) ORDER BY id FOR UPDATE SKIP LOCKED
           )
           SELECT a.id AS "id!: AttemptId" FROM attempts a, patience
           WHERE a.id = ANY($1) AND a.job_id IN (SELECT id FROM jobs_taken)
           ORDER BY a.id
           FOR UPDATE OF a SKIP LOCKED"#,
        &attempts,
        &jobs,
        patience,
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    if taken.len() == rows.len() {
        return Ok(BTreeSet::new());
    }
    let missing: Vec<Uuid> = rows
        .iter()
        .filter(|r| !taken.contains(&r.0))
        .map(|r| r.0.0)
        .collect();
    Ok(sqlx::query_scalar!(
        r#"SELECT id AS "id!: AttemptId" FROM attempts WHERE id = ANY($1)"#,
        &missing
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect())
}

/// Creates the planned attempts; a job that was `unknown` runs again.
async fn insert_next_attempts(tx: &mut PgConnection, next_attempts: &[NextAttempt]) -> Result<()> {
    if next_attempts.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = next_attempts.iter().map(|n| n.id.0).collect();
    let jobs: Vec<Uuid> = next_attempts.iter().map(|n| n.job.0).collect();
    let numbers: Vec<i32> = next_attempts.iter().map(|n| n.number).collect();
    let providers: Vec<String> = next_attempts.iter().map(|n| n.provider.clone()).collect();
    let not_before: Vec<Option<DateTime<Utc>>> =
        next_attempts.iter().map(|n| n.not_before).collect();
    sqlx::query!(
        "WITH new AS (
             INSERT INTO attempts (id, job_id, number, provider, not_before)
             SELECT n.id, n.job_id, n.number, n.provider, COALESCE(n.not_before, now())
             FROM unnest($1::uuid[], $2::uuid[], $3::int[], $4::text[], $5::timestamptz[])
                  AS n(id, job_id, number, provider, not_before)
             RETURNING job_id
         )
         UPDATE jobs j SET status = 'running', updated_at = now()
         FROM new WHERE j.id = new.job_id AND j.status = 'unknown'",
        &ids,
        &jobs,
        &numbers,
        &providers,
        &not_before as &[Option<DateTime<Utc>>],
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A row of [`compare_and_swap`]: a won job, or a discarded attempt.
struct CasRow {
    job_id: Option<JobId>,
    version: Option<i64>,
    owner_id: Option<String>,
    idempotency_key: Option<String>,
    operation: Option<String>,
    status: Option<JobStatus>,
    completed_by: Option<AttemptId>,
    result: Option<Value>,
    error: Option<String>,
    discarded_job: Option<Uuid>,
}

/// The compare-and-swap itself, one statement for the whole batch: lock the
/// open attempts, move each job's `completed_by` from NULL where its version
/// still matches, settle every attempt as `succeeded` or `discarded`, and keep
/// the usage of attempts that had already ended. One statement, so that all of
/// it works from one snapshot.
async fn compare_and_swap(tx: &mut PgConnection, wins: &[&Finished]) -> Result<Vec<CasRow>> {
    let attempt_ids: Vec<Uuid> = wins.iter().map(|f| f.attempt_id.0).collect();
    let job_ids: Vec<Uuid> = wins.iter().map(|f| f.job_id.0).collect();
    let versions: Vec<i64> = wins.iter().map(|f| f.version).collect();
    let results: Vec<Value> = wins
        .iter()
        .map(|f| match &f.verdict {
            Verdict::Succeeded(v) => v.clone(),
            _ => Value::Null,
        })
        .collect();
    let usages: Vec<Option<Value>> = wins.iter().map(|f| f.usage.clone()).collect();
    let request_ids: Vec<Option<String>> =
        wins.iter().map(|f| f.provider_request_id.clone()).collect();
    Ok(sqlx::query_as!(
        CasRow,
        r#"WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::bigint[], $4::jsonb[], $5::jsonb[], $6::text[])
                 AS t(attempt_id, job_id, version, result, usage, request_id)
         ), open AS (
             SELECT a.id FROM attempts a JOIN input i ON a.id = i.attempt_id AND a.job_id = i.job_id
             WHERE (a.status IN ('started', 'unknown')) IS TRUE
             ORDER BY a.id
             FOR UPDATE OF a
         ), won AS (
             UPDATE jobs j
             SET status = 'succeeded', result = i.result, completed_by = i.attempt_id,
                 version = j.version + 1, error = NULL, updated_at = now()
             FROM input i JOIN open o ON o.id = i.attempt_id
             WHERE j.id = i.job_id AND j.version = i.version AND j.completed_by IS NULL
               AND j.status IN ('queued', 'running', 'unknown')
             RETURNING j.id, j.version, j.owner_id, j.idempotency_key, j.operation, j.status,
                       j.completed_by, j.result, j.error
         ), settled AS (
             UPDATE attempts a
             SET status = CASE WHEN w.id IS NOT NULL THEN 'succeeded' ELSE 'discarded' END,
                 error = CASE WHEN w.id IS NULL
                              THEN 'discarded: another attempt had already won, or the job had ended' END,
                 finished_at = now(), usage = i.usage, provider_request_id = i.request_id
             FROM input i JOIN open o ON o.id = i.attempt_id
                  LEFT JOIN won w ON w.completed_by = i.attempt_id
             WHERE a.id = i.attempt_id
             RETURNING a.id, a.status
         ), late AS (
             UPDATE attempts a
             SET usage = COALESCE(a.usage, i.usage),
                 provider_request_id = COALESCE(a.provider_request_id, i.request_id)
             FROM input i
             WHERE a.id = i.attempt_id AND a.id NOT IN (SELECT id FROM open)
             RETURNING a.id
         )
         SELECT w.id AS "job_id: JobId", w.version, w.owner_id, w.idempotency_key,
                w.operation, w.status AS "status: JobStatus",
                w.completed_by AS "completed_by: AttemptId", w.result, w.error,
                NULL::uuid AS discarded_job
         FROM won w
         UNION ALL
         SELECT NULL, NULL, NULL, NULL, NULL, NULL, s.id, NULL, NULL, i.job_id
         FROM settled s JOIN input i ON i.attempt_id = s.id
         WHERE s.status = 'discarded'"#,
        &attempt_ids,
        &job_ids,
        &versions,
        &results,
        &usages as &[Option<Value>],
        &request_ids as &[Option<String>],
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// What the compare-and-swap's rows say, read without I/O.
#[derive(Debug, Default)]
struct CasOutcomes {
    /// `Won` for each winning attempt.
    outcomes: Vec<(AttemptId, Settled)>,
    /// The `job.succeeded` event of each won job.
    events: Vec<OutboxDraft>,
    /// `(job, winner)` of each won job.
    won: Vec<(Uuid, Uuid)>,
    /// `(attempt, job)` of each discarded attempt.
    discarded: Vec<(AttemptId, Uuid)>,
}

/// Reads the compare-and-swap's rows: each is a won job (its event's columns)
/// or a discarded attempt (`completed_by` then carries the attempt,
/// `discarded_job` its job).
fn cas_outcomes(rows: Vec<CasRow>, routes: &Routes) -> Result<CasOutcomes> {
    let mut out = CasOutcomes::default();
    for row in rows {
        let (Some(attempt), discarded_job) = (row.completed_by, row.discarded_job) else {
            return Err(corrupt("settled row without an attempt"));
        };
        if let Some(job) = discarded_job {
            out.discarded.push((attempt, job));
            continue;
        }
        let ended = Ended {
            job_id: row
                .job_id
                .ok_or_else(|| corrupt("won row without its job"))?,
            version: row.version.unwrap_or_default(),
            owner_id: row.owner_id.unwrap_or_default(),
            idempotency_key: row.idempotency_key.unwrap_or_default(),
            operation: row.operation.unwrap_or_default(),
            status: row.status.unwrap_or(JobStatus::Succeeded),
            completed_by: Some(attempt),
            result: row.result,
            error: row.error,
        };
        out.won.push((ended.job_id.0, attempt.0));
        out.events.push(ended.draft(routes));
        out.outcomes.push((attempt, Settled::Won));
    }
    Ok(out)
}

/// The winners of the jobs whose compare-and-swap failed, read by a statement
/// of its own: its fresh snapshot sees the winner that made it fail.
async fn winners_of(
    tx: &mut PgConnection,
    discarded: &[(AttemptId, Uuid)],
) -> Result<HashMap<Uuid, Option<AttemptId>>> {
    if discarded.is_empty() {
        return Ok(HashMap::new());
    }
    let jobs: Vec<Uuid> = discarded.iter().map(|(_, j)| *j).collect();
    Ok(sqlx::query!(
        r#"SELECT id, completed_by AS "completed_by: AttemptId" FROM jobs WHERE id = ANY($1)"#,
        &jobs
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, r.completed_by))
    .collect())
}

/// An attempt planned after a definite failure. `not_before` is `None` when it is
/// due now: its writer publishes it at once instead of leaving it to the relay.
#[derive(Debug)]
struct NextAttempt {
    id: AttemptId,
    job: JobId,
    number: i32,
    provider: String,
    not_before: Option<DateTime<Utc>>,
}

/// What `settle_failures` needs to know of a job's attempts.
#[derive(Debug)]
struct AttemptCounts {
    job_id: Uuid,
    made: i64,
    max_number: i32,
    /// Some attempt is `queued`, `started` or `unknown`.
    open: bool,
    /// Some attempt is `unknown`.
    unknown: bool,
    /// The `queued` attempts, and their providers.
    queued: Vec<Uuid>,
    queued_providers: Vec<String>,
}

/// An attempt [`mark_failed`] changed.
#[derive(Debug)]
struct FailedAttempt {
    attempt_id: Uuid,
    job_id: Uuid,
    provider: String,
    error: String,
}

/// Marks the attempts `failed` where their status is one of `from`; returns
/// those it changed.
async fn mark_failed(
    tx: &mut PgConnection,
    failures: &[Failure],
    from: &[AttemptStatus],
) -> Result<Vec<FailedAttempt>> {
    let ids: Vec<Uuid> = failures.iter().map(|f| f.attempt_id.0).collect();
    let errors: Vec<String> = failures.iter().map(|f| f.error.clone()).collect();
    let usages: Vec<Option<Value>> = failures.iter().map(|f| f.usage.clone()).collect();
    let request_ids: Vec<Option<String>> = failures.iter().map(|f| f.request_id.clone()).collect();
    Ok(sqlx::query_as!(
        FailedAttempt,
        r#"UPDATE attempts a
             SET status = 'failed', error = i.error, finished_at = now(),
                 usage = COALESCE(i.usage, a.usage),
                 provider_request_id = COALESCE(i.request_id, a.provider_request_id)
             FROM unnest($1::uuid[], $2::text[], $3::jsonb[], $4::text[])
                  AS i(attempt_id, error, usage, request_id)
             WHERE a.id = i.attempt_id AND a.status = ANY($5)
             RETURNING a.id AS attempt_id, a.job_id, a.provider, a.error AS "error!""#,
        &ids,
        &errors,
        &usages as &[Option<Value>],
        &request_ids as &[Option<String>],
        from as &[AttemptStatus],
    )
    .fetch_all(&mut *tx)
    .await?)
}

/// Locks the jobs (in id order), then reads their attempts in a new statement:
/// its fresh snapshot sees any attempt another transaction committed while this
/// one waited for the lock.
async fn lock_jobs(tx: &mut PgConnection, job_ids: &[Uuid]) -> Result<HashMap<Uuid, JobState>> {
    let jobs: HashMap<Uuid, (JobStatus, String)> = sqlx::query!(
        r#"SELECT id, status AS "status: JobStatus", operation
           FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE"#,
        job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, (r.status, r.operation)))
    .collect();
    let mut counts: HashMap<Uuid, AttemptCounts> = sqlx::query_as!(
        AttemptCounts,
        r#"SELECT job_id, count(*) AS "made!", max(number) AS "max_number!",
                  bool_or(status IN ('queued', 'started', 'unknown')) AS "open!",
                  bool_or(status = 'unknown') AS "unknown!",
                  COALESCE(array_agg(id) FILTER (WHERE status = 'queued'), '{}') AS "queued!",
                  COALESCE(array_agg(provider) FILTER (WHERE status = 'queued'), '{}')
                      AS "queued_providers!"
           FROM attempts WHERE job_id = ANY($1) GROUP BY job_id"#,
        job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|c| (c.job_id, c))
    .collect();
    let mut states = HashMap::new();
    for (id, (status, operation)) in jobs {
        let counts = counts
            .remove(&id)
            .ok_or_else(|| corrupt(format!("job {id} has no attempts")))?;
        states.insert(
            id,
            JobState {
                status,
                operation,
                counts,
            },
        );
    }
    Ok(states)
}

/// A locked job, as the planning of its failures needs it.
struct JobState {
    status: JobStatus,
    operation: String,
    counts: AttemptCounts,
}

/// What settling a batch of definite failures does, decided without I/O.
#[derive(Debug, Default)]
struct FailurePlan {
    /// Attempts to create.
    next_attempts: Vec<NextAttempt>,
    /// Jobs that fail, with their error.
    give_up: Vec<(Uuid, String)>,
    /// Jobs whose last unknown this batch lifted: they run again.
    unblocked: Vec<Uuid>,
    /// Queued attempts of those jobs to publish again: (attempt, job, provider).
    republish: Vec<(Uuid, Uuid, String)>,
    /// The failed attempt whose settlement created each next attempt.
    triggered: HashMap<Uuid, AttemptId>,
}

/// Plans what follows each failed attempt of the locked `jobs`: nothing for an ended job or one already planned in
/// this batch; for a job with another open attempt, only lifting its block when
/// no unknown is left; otherwise the caller's `plan` (the route rule). A retry
/// due at once (or any, when `immediate`) has no not-before time.
fn plan_failures(
    failed: &[FailedAttempt],
    jobs: &HashMap<Uuid, JobState>,
    failures: &[Failure],
    plan: &(dyn Fn(&FailedJob) -> NextStep + Sync),
    immediate: bool,
    now: DateTime<Utc>,
) -> Result<FailurePlan> {
    let by_attempt: HashMap<Uuid, &Failure> =
        failures.iter().map(|f| (f.attempt_id.0, f)).collect();
    let mut out = FailurePlan::default();
    let mut planned: BTreeSet<Uuid> = BTreeSet::new();
    for FailedAttempt {
        attempt_id: attempt,
        job_id: job,
        provider,
        error,
    } in failed
    {
        let Some(state) = jobs.get(job) else {
            return Err(corrupt(format!("attempt {attempt} has no job {job}")));
        };
        let c = &state.counts;
        if state.status.is_terminal() || !planned.insert(*job) {
            continue;
        }
        // Another open attempt (a hedge) carries on. If this failure lifted the
        // job's last unknown, the job runs again, and an attempt whose delivery
        // was turned away while it was blocked is published once more.
        if c.open {
            if state.status == JobStatus::Unknown && !c.unknown {
                out.unblocked.push(*job);
                for (id, p) in c.queued.iter().zip(&c.queued_providers) {
                    out.republish.push((*id, *job, p.clone()));
                }
            }
            continue;
        }
        let step = plan(&FailedJob {
            job_id: JobId(*job),
            operation: state.operation.clone(),
            failed_provider: provider.clone(),
            attempts_made: u32::try_from(c.made).unwrap_or(u32::MAX),
            error: error.clone(),
            retryable: by_attempt.get(attempt).is_none_or(|f| f.retryable),
            retry_after: by_attempt.get(attempt).and_then(|f| f.retry_after),
        });
        match step {
            NextStep::Retry { provider, delay } => {
                let id = AttemptId::new();
                let delay = if immediate { Duration::ZERO } else { delay };
                out.next_attempts.push(NextAttempt {
                    id,
                    job: JobId(*job),
                    number: c.max_number + 1,
                    provider,
                    not_before: (!delay.is_zero()).then(|| later(now, delay)),
                });
                out.triggered.insert(*attempt, id);
            }
            NextStep::GiveUp { error } => out.give_up.push((*job, error)),
        }
    }
    Ok(out)
}

/// One definite failure to settle.
struct Failure {
    attempt_id: AttemptId,
    error: String,
    retryable: bool,
    retry_after: Option<Duration>,
    usage: Option<Value>,
    request_id: Option<String>,
}

/// Timeouts: each still-`started` attempt becomes `unknown` and blocks its job,
/// unless the job has already ended (another attempt won, or it was cancelled):
/// then nothing is blocked any more, and the attempt is `discarded` with the
/// reason. Attempts are locked first, then their jobs, as everywhere.
pub(super) async fn mark_unknown(
    tx: &mut PgConnection,
    unknowns: &[(AttemptId, String)],
) -> Result<HashMap<AttemptId, Settled>> {
    let ids: Vec<Uuid> = unknowns.iter().map(|u| u.0.0).collect();
    let locked: Vec<(Uuid, Uuid)> = sqlx::query!(
        "SELECT id, job_id FROM attempts WHERE id = ANY($1) AND status = 'started'
         ORDER BY id FOR UPDATE",
        &ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, r.job_id))
    .collect();
    if locked.is_empty() {
        return Ok(HashMap::new());
    }
    let job_ids: Vec<Uuid> = locked
        .iter()
        .map(|l| l.1)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // Locked, then read by a new statement: a job that ended meanwhile is seen ended.
    let jobs: HashMap<Uuid, (JobStatus, Option<AttemptId>)> = sqlx::query!(
        r#"SELECT id, status AS "status: JobStatus", completed_by AS "completed_by: AttemptId"
           FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE"#,
        &job_ids
    )
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.id, (r.status, r.completed_by)))
    .collect();
    let errors: HashMap<AttemptId, &str> =
        unknowns.iter().map(|(id, e)| (*id, e.as_str())).collect();
    let mut outcomes = HashMap::new();
    let (mut ids, mut statuses, mut texts) = (Vec::new(), Vec::new(), Vec::new());
    for (attempt, job) in &locked {
        let attempt = AttemptId(*attempt);
        let error = errors.get(&attempt).copied().unwrap_or_default();
        let (status, winner) = jobs
            .get(job)
            .ok_or_else(|| corrupt(format!("attempt {attempt} has no job {job}")))?;
        ids.push(attempt.0);
        if status.is_terminal() {
            statuses.push(AttemptStatus::Discarded);
            texts.push(format!("discarded: {error} (after its job had ended)"));
            outcomes.insert(attempt, Settled::Discarded { winner: *winner });
        } else {
            statuses.push(AttemptStatus::Unknown);
            texts.push(error.to_owned());
            outcomes.insert(attempt, Settled::Unknown);
        }
    }
    sqlx::query!(
        "WITH marked AS (
             UPDATE attempts a
             SET status = i.status, error = i.error,
                 finished_at = CASE WHEN i.status = 'discarded' THEN now() END
             FROM unnest($1::uuid[], $2::text[], $3::text[]) AS i(attempt_id, status, error)
             WHERE a.id = i.attempt_id
             RETURNING a.job_id, a.status
         )
         UPDATE jobs j SET status = 'unknown', updated_at = now()
         FROM (SELECT DISTINCT job_id FROM marked WHERE status = 'unknown') m
         WHERE j.id = m.job_id AND j.status = 'running'",
        &ids,
        &statuses as &[AttemptStatus],
        &texts,
    )
    .execute(&mut *tx)
    .await?;
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> Routes {
        Routes {
            work_exchange: "onejob".into(),
            events_exchange: "onejob.events".into(),
            lease: Duration::from_secs(30),
        }
    }

    fn won_row(job: Uuid, attempt: Uuid, version: i64) -> CasRow {
        CasRow {
            job_id: Some(JobId(job)),
            version: Some(version),
            owner_id: Some("acct".into()),
            idempotency_key: Some("k".into()),
            operation: Some("op".into()),
            status: Some(JobStatus::Succeeded),
            completed_by: Some(AttemptId(attempt)),
            result: Some(serde_json::json!({"summary": "s"})),
            error: None,
            discarded_job: None,
        }
    }

    #[test]
    fn a_won_row_wins_and_writes_its_event_a_discarded_row_only_waits_for_its_winner() {
        let (job, winner, late, other_job) = (
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
        );
        let discarded = CasRow {
            job_id: None,
            version: None,
            owner_id: None,
            idempotency_key: None,
            operation: None,
            status: None,
            completed_by: Some(AttemptId(late)),
            result: None,
            error: None,
            discarded_job: Some(other_job),
        };
        let out = cas_outcomes(vec![won_row(job, winner, 3), discarded], &routes()).unwrap();
        assert_eq!(out.outcomes, vec![(AttemptId(winner), Settled::Won)]);
        assert_eq!(out.won, vec![(job, winner)]);
        assert_eq!(out.discarded, vec![(AttemptId(late), other_job)]);
        let event = &out.events[0];
        assert_eq!(
            (event.exchange.as_str(), event.routing_key.as_str()),
            ("onejob.events", "job.succeeded")
        );
        // The event id is job:version, so a re-published event deduplicates.
        assert_eq!(event.message_id, format!("{job}:3"));
        assert_eq!(event.body["status"], "succeeded");
        assert_eq!(event.body["completed_by"], winner.to_string());
        assert_eq!(event.body["result"]["summary"], "s");
    }

    #[test]
    fn a_row_without_its_attempt_is_corrupt_not_a_guess() {
        let mut row = won_row(Uuid::now_v7(), Uuid::now_v7(), 1);
        row.completed_by = None;
        assert!(matches!(
            cas_outcomes(vec![row], &routes()),
            Err(StoreError::Corrupt(_))
        ));
        let mut row = won_row(Uuid::now_v7(), Uuid::now_v7(), 1);
        row.job_id = None;
        assert!(cas_outcomes(vec![row], &routes()).is_err());
    }

    #[test]
    fn an_ended_job_publishes_the_event_of_its_status() {
        for (status, kind) in [
            (JobStatus::Succeeded, "job.succeeded"),
            (JobStatus::Failed, "job.failed"),
            (JobStatus::Cancelled, "job.cancelled"),
        ] {
            let job = JobId::new();
            let draft = Ended {
                job_id: job,
                version: 7,
                owner_id: "acct".into(),
                idempotency_key: "k".into(),
                operation: "op".into(),
                status,
                completed_by: None,
                result: None,
                error: Some("e".into()),
            }
            .draft(&routes());
            assert_eq!(draft.routing_key, kind);
            assert_eq!(draft.message_id, format!("{job}:7"));
            assert_eq!(draft.body["status"], status.as_str());
            assert_eq!(draft.body["type"], kind);
            assert_eq!(draft.not_before, None, "events go out at once");
        }
    }

    #[test]
    fn an_event_says_no_more_than_the_gateway_of_why_a_job_failed() {
        let draft = Ended {
            job_id: JobId::new(),
            version: 3,
            owner_id: "acct".into(),
            idempotency_key: "k".into(),
            operation: "op".into(),
            status: JobStatus::Failed,
            completed_by: None,
            result: None,
            error: Some(
                r#"provider_error: HTTP 401: {"error":"bad key sk-123 for tenant x"}"#.into(),
            ),
        }
        .draft(&routes());
        assert_eq!(
            draft.body["error"],
            "provider_error: the provider refused the request"
        );
    }

    fn counts(
        job: Uuid,
        made: i64,
        open: bool,
        unknown: bool,
        queued: &[(Uuid, &str)],
    ) -> AttemptCounts {
        AttemptCounts {
            job_id: job,
            made,
            max_number: i32::try_from(made).unwrap(),
            open,
            unknown,
            queued: queued.iter().map(|q| q.0).collect(),
            queued_providers: queued.iter().map(|q| q.1.to_owned()).collect(),
        }
    }

    fn state(status: JobStatus, c: AttemptCounts) -> JobState {
        JobState {
            status,
            operation: "op".into(),
            counts: c,
        }
    }

    fn failure(attempt: Uuid) -> Failure {
        Failure {
            attempt_id: AttemptId(attempt),
            error: "provider_error: HTTP 500".into(),
            retryable: true,
            retry_after: None,
            usage: None,
            request_id: None,
        }
    }

    fn retry_in(delay: Duration) -> impl Fn(&FailedJob) -> NextStep + Sync {
        move |_| NextStep::Retry {
            provider: "b".into(),
            delay,
        }
    }

    fn row(attempt: Uuid, job: Uuid) -> FailedAttempt {
        FailedAttempt {
            attempt_id: attempt,
            job_id: job,
            provider: "a".into(),
            error: "provider_error: HTTP 500".into(),
        }
    }

    #[test]
    fn a_failure_plans_the_next_attempt_once_per_job() {
        let (job, a1, a2) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let jobs = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 2, false, false, &[])),
        )]);
        let now = Utc::now();
        // Two failures of one job in one batch (a hedge and its primary): one plan.
        let plan = plan_failures(
            &[row(a1, job), row(a2, job)],
            &jobs,
            &[failure(a1), failure(a2)],
            &retry_in(Duration::from_secs(5)),
            false,
            now,
        )
        .unwrap();
        assert_eq!(plan.next_attempts.len(), 1);
        let next = &plan.next_attempts[0];
        assert_eq!((next.number, next.provider.as_str()), (3, "b"));
        assert_eq!(next.not_before, Some(later(now, Duration::from_secs(5))));
        assert_eq!(plan.triggered.get(&a1), Some(&next.id));
        assert!(plan.give_up.is_empty() && plan.unblocked.is_empty());
        // An operator's resolution retries at once: no not-before time.
        let at_once = plan_failures(
            &[row(a1, job)],
            &jobs,
            &[failure(a1)],
            &retry_in(Duration::from_secs(5)),
            true,
            now,
        )
        .unwrap();
        assert_eq!(at_once.next_attempts[0].not_before, None);
    }

    #[test]
    fn nothing_is_planned_for_an_ended_job_and_giving_up_fails_it() {
        let (job, a1) = (Uuid::now_v7(), Uuid::now_v7());
        let ended = HashMap::from([(
            job,
            state(JobStatus::Cancelled, counts(job, 1, false, false, &[])),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &ended,
            &[failure(a1)],
            &retry_in(Duration::ZERO),
            false,
            Utc::now(),
        )
        .unwrap();
        assert!(plan.next_attempts.is_empty() && plan.give_up.is_empty());
        let running = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 3, false, false, &[])),
        )]);
        let give_up = |f: &FailedJob| NextStep::GiveUp {
            error: f.error.clone(),
        };
        let plan = plan_failures(
            &[row(a1, job)],
            &running,
            &[failure(a1)],
            &give_up,
            false,
            Utc::now(),
        )
        .unwrap();
        assert_eq!(
            plan.give_up,
            vec![(job, "provider_error: HTTP 500".to_owned())]
        );
    }

    #[test]
    fn a_lifted_block_runs_the_job_again_and_republishes_what_waited() {
        let (job, a1, hedge) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let never = |_: &FailedJob| -> NextStep { panic!("no plan beside an open attempt") };
        // The unknown primary is resolved as failed; a hedge waits, queued.
        let blocked = HashMap::from([(
            job,
            state(
                JobStatus::Unknown,
                counts(job, 2, true, false, &[(hedge, "b")]),
            ),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &blocked,
            &[failure(a1)],
            &never,
            true,
            Utc::now(),
        )
        .unwrap();
        assert_eq!(plan.unblocked, vec![job]);
        assert_eq!(plan.republish, vec![(hedge, job, "b".to_owned())]);
        assert!(plan.next_attempts.is_empty());
        // Another attempt is still unknown: the job stays blocked.
        let still = HashMap::from([(
            job,
            state(
                JobStatus::Unknown,
                counts(job, 3, true, true, &[(hedge, "b")]),
            ),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &still,
            &[failure(a1)],
            &never,
            true,
            Utc::now(),
        )
        .unwrap();
        assert!(plan.unblocked.is_empty() && plan.republish.is_empty());
        // A running job with a hedge in flight: the hedge carries on.
        let running = HashMap::from([(
            job,
            state(JobStatus::Running, counts(job, 2, true, false, &[])),
        )]);
        let plan = plan_failures(
            &[row(a1, job)],
            &running,
            &[failure(a1)],
            &never,
            false,
            Utc::now(),
        )
        .unwrap();
        assert!(
            plan.unblocked.is_empty() && plan.next_attempts.is_empty() && plan.give_up.is_empty()
        );
    }
}
