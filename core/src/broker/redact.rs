//! URLs for logs and errors: passwords and query values masked, and a URL
//! whose login was cut short refused before any driver reads it.

/// What to say of a URL whose login was cut short ([`login_cut_short`]).
pub const CUT_SHORT: &str = "'@' after the host: a password with an unencoded '#', '/' or '?' \
     ends the login there; percent-encode them (%23, %2F, %3F)";

/// Whether a URL (or any node of a comma-separated list) has an '@' past its
/// host: its authority was cut short, since a password pasted with an
/// unencoded '#', '/' or '?' ends it there, and the rest of the password sits
/// in the path, the query or the fragment, where a driver may log it as it
/// parses. Such a URL is refused before any driver sees it.
pub fn login_cut_short(url: &str) -> bool {
    url.split(',').any(|piece| {
        url::Url::parse(piece.trim()).is_ok_and(|parsed| {
            parsed.has_host()
                && [Some(parsed.path()), parsed.query(), parsed.fragment()]
                    .into_iter()
                    .flatten()
                    .any(|part| part.contains('@'))
        })
    })
}

/// Replaces the password in a URL with `***`, for logs and errors.
pub fn redact_url(url: &str) -> String {
    // One URL: shown only when it parses with an authority, its password masked.
    // Anything else could be a password split off at a comma, and is not shown.
    let one = |u: &str| match url::Url::parse(u) {
        Ok(parsed) if login_cut_short(u) => {
            format!("{}://<hidden: {CUT_SHORT}>", parsed.scheme())
        }
        Ok(mut parsed) if parsed.has_host() => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            // A query may carry a secret (`password=`, an API key): its values
            // are masked, its keys kept; a fragment is never shown.
            if parsed.query().is_some() {
                let keys: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
                let masked = keys
                    .iter()
                    .map(|k| format!("{k}=***"))
                    .collect::<Vec<_>>()
                    .join("&");
                parsed.set_query(Some(&masked));
            }
            parsed.set_fragment(None);
            parsed.to_string()
        }
        _ => "<unparseable url>".to_owned(),
    };
    // A list of nodes: each piece on its own. A piece that is not a URL (a
    // password cut at an unencoded comma, say) is not shown, and the whole text
    // is never parsed as one URL: its path would carry the other pieces, their
    // passwords in clear.
    if url.contains(',') {
        return url
            .split(',')
            .map(|piece| match piece.trim() {
                "" => String::new(),
                piece => one(piece),
            })
            .collect::<Vec<_>>()
            .join(",");
    }
    one(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_passwords() {
        let r = redact_url("amqp://guest:hunter2@127.0.0.1:5672/%2f");
        assert!(!r.contains("hunter2"), "{r}");
        assert!(r.contains("***"));
        assert!(!redact_url("postgres://u:pw@h/db").contains("pw@"));
        assert_eq!(redact_url("::"), "<unparseable url>");
        // A comma inside a password is not a list; a piece that is not a URL
        // with an authority is never shown.
        let r = redact_url("postgres://u:pa,ss:word@h/db");
        assert!(!r.contains("pa,") && !r.contains("word"), "{r}");
        assert_eq!(redact_url("amqp:u:secret@h/%2f"), "<unparseable url>");
    }

    #[test]
    fn a_password_with_characters_that_end_the_authority_is_never_shown() {
        // Pasted unencoded: the URL parser ends the authority at '#', '/' or
        // '?', so the rest of the password lands in the fragment, the path or
        // the query.
        for url in [
            "amqp://svc:2024#Winter@host/",
            "amqp://svc:2024/Winter@host/%2f",
            "amqp://svc:2024?Winter@host/",
            "postgres://svc:pa#Winter@db:5432/onejob",
            "postgres://svc:12/Winter@db/onejob",
            "postgres://u@h/db?password=Winter&sslmode=disable",
            "http://127.0.0.1:8081/v1?api-key=Winter",
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains("Winter"), "{url} -> {shown}");
        }
        assert_eq!(
            redact_url("postgres://u@h/db?password=Winter&sslmode=disable"),
            "postgres://u@h/db?password=***&sslmode=***"
        );
    }

    #[test]
    fn every_node_of_a_list_is_masked() {
        let list = "amqp://guest:pw1@127.0.0.1:5673/%2f, amqp://guest:pw2@127.0.0.1:5674/%2f,amqp://guest:pw3@h3:5675/%2f";
        let r = redact_url(list);
        for secret in ["pw1", "pw2", "pw3"] {
            assert!(!r.contains(secret), "{r}");
        }
        assert_eq!(r.matches("***").count(), 3, "{r}");
        assert!(r.contains("127.0.0.1:5674") && r.contains("h3:5675"), "{r}");
    }
}
