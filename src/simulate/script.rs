//! The inputs of `idem simulate`, parsed into values that can only be valid: the outcome script
//! (what the upstream does on each attempt, in order) and the fixed jitter draws.
//!
//! ```text
//! script  = item *("," item)
//! item    = DURATION ":" RESULT [" retry-after=" VALUE] [" cancel"]
//! RESULT  = status 100–599 | "timeout" | "connect-failed" | "broken" | "cancel"
//! VALUE   = delta-seconds ("3") | DURATION ("300ms")
//! ```

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use crate::domain::AttemptError;
use crate::policy::{self, Observed};

/// The logical clock ticks in milliseconds, so finer durations are refused rather than rounded.
const TICK: Duration = Duration::from_millis(1);

/// Longer than any deadline a config accepts: a larger value is a typo.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// What one attempt meets upstream, as scripted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encounter {
    /// The item as written, to show it back in the trace.
    pub text: String,
    /// When, from the attempt's start, the result comes.
    pub after: Duration,
    pub result: Scripted,
    /// The upstream's `Retry-After`; only a status can carry one.
    pub retry_after: Option<Duration>,
    /// The caller cancels while this attempt is in flight. The attempt still finishes and its
    /// outcome decides the record's state, as in the broker.
    pub cancel: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scripted {
    Status(u16),
    /// No answer within the item's duration, after the request may have been written.
    Timeout,
    /// Nothing was sent.
    ConnectFailed,
    /// The connection was cut after the request may have been written.
    Broken,
}

impl Scripted {
    /// The results a script writes as a word, each spelt by the attempt error it stands for.
    const WORDS: [(Scripted, AttemptError); 3] = [
        (Scripted::Timeout, AttemptError::TimedOut),
        (Scripted::ConnectFailed, AttemptError::ConnectFailed),
        (Scripted::Broken, AttemptError::Broken),
    ];

    fn from_word(word: &str) -> Option<Scripted> {
        Scripted::WORDS.into_iter().find(|(_, error)| error.script_word() == word).map(|(scripted, _)| scripted)
    }
}

impl Encounter {
    /// What the broker would see of it if it came within the attempt's limit.
    pub fn observed(&self) -> Observed {
        match self.result {
            Scripted::Status(status) => Observed::Response(status),
            Scripted::Timeout => Observed::TimedOut,
            Scripted::ConnectFailed => Observed::ConnectFailed,
            Scripted::Broken => Observed::Broken,
        }
    }
}

/// A whole outcome script: at least one item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Script(Vec<Encounter>);

impl Script {
    pub fn outcomes(&self) -> &[Encounter] {
        &self.0
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    #[error("no outcomes: give at least one DURATION:RESULT, e.g. \"400ms:503 retry-after=300ms, 700ms:200\"")]
    Empty,
    #[error("outcome {index} is empty: outcomes are DURATION:RESULT items separated by single commas")]
    EmptyItem { index: usize },
    #[error("outcome {index} (`{item}`): {problem}")]
    Item { index: usize, item: String, problem: String },
}

impl FromStr for Script {
    type Err = ScriptError;

    fn from_str(text: &str) -> Result<Script, ScriptError> {
        if text.trim().is_empty() {
            return Err(ScriptError::Empty);
        }
        let outcomes = text
            .split(',')
            .enumerate()
            .map(|(i, item)| {
                let index = i + 1;
                let item = item.trim();
                if item.is_empty() {
                    return Err(ScriptError::EmptyItem { index });
                }
                outcome(item).map_err(|problem| ScriptError::Item { index, item: item.to_string(), problem })
            })
            .collect::<Result<_, _>>()?;
        Ok(Script(outcomes))
    }
}

fn outcome(item: &str) -> Result<Encounter, String> {
    let Some((after, rest)) = item.split_once(':') else {
        return Err("expected DURATION:RESULT, e.g. 400ms:503".into());
    };
    let after = duration(after, "duration")?;
    let mut words = rest.split_whitespace();
    let Some(first) = words.next() else {
        return Err("the result is missing after `:`".into());
    };
    let word = first.to_ascii_lowercase();
    let (result, mut cancel) = match word.as_str() {
        _ if let Some(scripted) = Scripted::from_word(&word) => (scripted, false),
        // The script does not say what the cancelled attempt returned; the safe reading of an
        // answer nobody saw is that it may have executed.
        "cancel" => (Scripted::Broken, true),
        word if word.bytes().all(|b| b.is_ascii_digit()) => match word.parse::<u16>() {
            Ok(status) if (100..=599).contains(&status) => (Scripted::Status(status), false),
            _ => return Err(format!("status `{first}` is outside 100–599")),
        },
        _ => {
            return Err(format!(
                "unknown result `{first}`: expected a status 100–599, timeout, connect-failed, broken or cancel"
            ))
        }
    };
    let mut retry_after = None;
    for word in words {
        let lower = word.to_ascii_lowercase();
        if lower == "cancel" {
            if cancel {
                return Err("`cancel` is given twice".into());
            }
            cancel = true;
        } else if let Some(value) = lower.strip_prefix("retry-after=") {
            if !matches!(result, Scripted::Status(_)) {
                return Err("only a status can carry a retry-after".into());
            }
            if retry_after.is_some() {
                return Err("retry-after is given twice".into());
            }
            retry_after = Some(retry_after_value(value)?);
        } else {
            return Err(format!("unexpected `{word}`: after the result come only retry-after=VALUE and cancel"));
        }
    }
    Ok(Encounter { text: item.to_string(), after, result, retry_after, cancel })
}

/// As in HTTP, delta-seconds; or, for the sub-second waits a simulation needs, a duration.
fn retry_after_value(value: &str) -> Result<Duration, String> {
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Read exactly as the worker reads the header; digits are never refused.
        return policy::parse_retry_after(value, SystemTime::UNIX_EPOCH)
            .ok_or_else(|| format!("retry-after `{value}` is not delta-seconds"));
    }
    duration(value, "retry-after").map_err(|problem| format!("{problem} (or give delta-seconds, e.g. 3)"))
}

fn duration(text: &str, what: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err(format!("the {what} is missing"));
    }
    if text.eq_ignore_ascii_case("true") || text.eq_ignore_ascii_case("false") {
        return Err(format!("`{text}` is a boolean, not a {what}: write a duration like 400ms"));
    }
    if text.starts_with('-') {
        return Err(format!("`{text}` is negative: a {what} cannot be"));
    }
    if text != "0" && text.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!("`{text}` has no unit: write {text}ms or {text}s"));
    }
    let parsed =
        humantime::parse_duration(text).map_err(|e| format!("`{text}` is not a {what} like 400ms or 1.5s ({e})"))?;
    if parsed > MAX_DURATION {
        return Err(format!("`{text}` is beyond any sane bound (at most 366 days)"));
    }
    if parsed.subsec_nanos() % TICK.subsec_nanos() != 0 {
        return Err(format!("`{text}` is finer than a millisecond, the simulation's tick"));
    }
    Ok(parsed)
}

/// Fixed jitter draws: one value fixes every draw; several are used in order, the last repeating,
/// so the draws printed by a random run reproduce it.
#[derive(Debug, Clone, PartialEq)]
pub struct Draws(Vec<f64>);

impl Draws {
    pub fn values(&self) -> &[f64] {
        &self.0
    }

    /// A source of draws: these in order, then the last one again and again.
    pub fn source(&self) -> impl FnMut() -> f64 + '_ {
        let mut next = 0;
        move || {
            let draw = self.0.get(next).or(self.0.last()).copied().unwrap_or(0.0);
            next += 1;
            draw
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("draw `{text}`: {problem}")]
pub struct DrawError {
    text: String,
    problem: &'static str,
}

impl FromStr for Draws {
    type Err = DrawError;

    fn from_str(text: &str) -> Result<Draws, DrawError> {
        let draws = text
            .split(',')
            .map(|item| {
                let item = item.trim();
                let error = |problem| DrawError { text: item.to_string(), problem };
                if item.is_empty() {
                    return Err(error("empty: give a number from 0 to 1, or several separated by commas"));
                }
                let draw = item.parse::<f64>().map_err(|_| error("not a number: give one from 0 to 1"))?;
                if !draw.is_finite() {
                    return Err(error("not a finite number: give one from 0 to 1"));
                }
                if !(0.0..=1.0).contains(&draw) {
                    return Err(error("outside 0 to 1"));
                }
                Ok(draw)
            })
            .collect::<Result<_, _>>()?;
        Ok(Draws(draws))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn parse(text: &str) -> Result<Vec<Encounter>, ScriptError> {
        text.parse::<Script>().map(|s| s.0)
    }

    fn problem(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn the_worked_example_parses() {
        let outcomes = parse("400ms:503 retry-after=300ms, 700ms:200, 100ms:200").unwrap();
        assert_eq!(outcomes.len(), 3);
        assert_eq!(outcomes[0].after, ms(400));
        assert_eq!(outcomes[0].result, Scripted::Status(503));
        assert_eq!(outcomes[0].retry_after, Some(ms(300)));
        assert_eq!(outcomes[0].text, "400ms:503 retry-after=300ms");
        assert_eq!(outcomes[1].retry_after, None);
        assert!(!outcomes[2].cancel);
    }

    #[test]
    fn every_result_and_modifier_is_understood() {
        let outcomes =
            parse("1.5s:timeout, 10ms:connect-failed, 2s:broken, 50ms:cancel, 0:429 retry-after=2 cancel, 1s:101")
                .unwrap();
        assert_eq!(outcomes[0].after, ms(1500));
        assert_eq!(outcomes[0].observed(), Observed::TimedOut);
        assert_eq!(outcomes[1].observed(), Observed::ConnectFailed);
        assert_eq!(outcomes[2].observed(), Observed::Broken);
        assert_eq!((outcomes[3].observed(), outcomes[3].cancel), (Observed::Broken, true));
        assert_eq!(outcomes[4].after, ms(0));
        assert_eq!(outcomes[4].retry_after, Some(Duration::from_secs(2)));
        assert!(outcomes[4].cancel);
        assert_eq!(outcomes[5].observed(), Observed::Response(101));
    }

    #[test]
    fn bad_items_are_refused_with_their_number_and_problem() {
        let cases = [
            ("true:200", "outcome 1 (`true:200`): `true` is a boolean"),
            ("400ms:200 retry-after=false", "`false` is a boolean"),
            ("-400ms:200", "`-400ms` is negative"),
            ("400ms:503 retry-after=-1", "`-1` is negative"),
            ("abc:200", "`abc` is not a duration"),
            ("400:200", "`400` has no unit"),
            ("1500us:200", "finer than a millisecond"),
            ("400ms:ok", "unknown result `ok`"),
            ("400ms:600", "status `600` is outside 100–599"),
            ("400ms:99", "status `99` is outside"),
            ("400ms:200, 100ms:2000000", "outcome 2 (`100ms:2000000`): status"),
            ("400ms", "expected DURATION:RESULT"),
            ("400ms:", "the result is missing"),
            (":200", "the duration is missing"),
            ("400ms:timeout retry-after=1", "only a status can carry a retry-after"),
            ("400ms:503 retry-after=1 retry-after=2", "given twice"),
            ("400ms:cancel cancel", "given twice"),
            ("400ms:503 please", "unexpected `please`"),
            ("400ms:503 retry-after=soon", "`soon` is not a retry-after"),
            ("400ms:503 retry-after=", "the retry-after is missing"),
            ("9999999h:200", "beyond any sane bound"),
        ];
        for (text, expected) in cases {
            let got = problem(text);
            assert!(got.contains(expected), "{text:?}: {got}");
        }
        assert_eq!(parse(""), Err(ScriptError::Empty));
        assert_eq!(parse("  "), Err(ScriptError::Empty));
        assert_eq!(parse("400ms:200,,100ms:200"), Err(ScriptError::EmptyItem { index: 2 }));
        assert_eq!(parse("400ms:200,"), Err(ScriptError::EmptyItem { index: 2 }));
    }

    #[test]
    fn a_huge_delta_seconds_means_later_than_any_deadline() {
        let outcomes = parse("1ms:503 retry-after=99999999999999999999").unwrap();
        assert_eq!(outcomes[0].retry_after, Some(Duration::from_secs(u32::MAX as u64)));
    }

    #[test]
    fn draws_are_finite_numbers_from_0_to_1() {
        let draws: Draws = "0.25, 1,0".parse().unwrap();
        let mut source = draws.source();
        assert_eq!([source(), source(), source(), source()], [0.25, 1.0, 0.0, 0.0]);
        for bad in ["NaN", "nan", "inf", "-inf", "1.5", "-0.1", "half", "", "0.5,", "true"] {
            let e = bad.parse::<Draws>().unwrap_err().to_string();
            assert!(e.starts_with("draw `"), "{bad:?}: {e}");
        }
    }

    proptest! {
        #[test]
        fn the_parser_never_panics(text in any::<String>()) {
            let _ = text.parse::<Script>();
            let _ = text.parse::<Draws>();
        }

        #[test]
        fn the_parser_never_panics_on_near_misses(
            text in r"[0-9.\-a-z]{0,6}(ms|s|h)?:([0-9]{1,4}|timeout|cancel|broken|x)( retry-after=[0-9a-z.\-]{0,8})?( cancel)?(, ?.{0,12})?"
        ) {
            if let Ok(script) = text.parse::<Script>() {
                prop_assert!(!script.outcomes().is_empty());
                for o in script.outcomes() {
                    prop_assert!(o.after <= MAX_DURATION);
                    prop_assert!(o.retry_after.is_none() || matches!(o.result, Scripted::Status(_)));
                }
            }
        }
    }
}
