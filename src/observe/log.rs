//! A rank's log on stderr, for programs that install no `tracing` subscriber of their own: a rank
//! started by `ferrorun` gets one at [`crate::init`], so its warnings (a peer lost, a transport
//! that fell back) are seen, each line prefixed with its rank by `ferrorun`.
//!
//! Dependency-free on purpose: a library should not make its users build a full subscriber
//! (`tracing-subscriber`'s env filter brings a regex engine). It reads `RUST_LOG` (default
//! `warn`) as comma-separated directives, `LEVEL` or `TARGET=LEVEL` (`TARGET` a prefix of the
//! module path: `ferrocomm=debug,warn`); span filters (`[...]`) are not understood and skipped. A
//! program that wants more installs its own subscriber before calling [`crate::init`], which then
//! leaves it alone.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, span};

/// What `RUST_LOG` lets through: a level per target prefix, and a default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// `(target prefix, level)`, longest prefix first; a level of `None` is `off`.
    targets: Vec<(String, LevelFilter)>,
    default: LevelFilter,
}

impl Filter {
    /// Parses `spec` in `RUST_LOG`'s form (see the module documentation); directives it does not
    /// understand are skipped. Without a bare level, the default is `warn`.
    pub fn parse(spec: &str) -> Filter {
        let mut f = Filter { targets: Vec::new(), default: LevelFilter::WARN };
        for d in spec.split(',').map(str::trim).filter(|d| !d.is_empty() && !d.contains('[')) {
            match d.split_once('=') {
                Some((target, level)) => {
                    if let Some(level) = level_of(level) {
                        f.targets.push((target.trim().to_string(), level));
                    }
                }
                None => match level_of(d) {
                    Some(level) => f.default = level,
                    None => f.targets.push((d.to_string(), LevelFilter::TRACE)),
                },
            }
        }
        // The most specific prefix decides.
        f.targets.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        f
    }

    /// The filter of `RUST_LOG`, or `warn` without it.
    pub fn from_env() -> Filter {
        Filter::parse(&std::env::var("RUST_LOG").unwrap_or_default())
    }

    /// The level that `target` is logged at.
    pub fn level_for(&self, target: &str) -> LevelFilter {
        self.targets.iter().find(|(t, _)| target.starts_with(t.as_str())).map_or(self.default, |&(_, l)| l)
    }

    /// Whether an event or span of `level` from `target` gets through.
    pub fn enabled(&self, target: &str, level: &Level) -> bool {
        self.level_for(target) >= *level
    }

    fn max(&self) -> LevelFilter {
        self.targets.iter().map(|&(_, l)| l).fold(self.default, LevelFilter::max)
    }
}

fn level_of(s: &str) -> Option<LevelFilter> {
    s.trim().parse().ok()
}

/// A `tracing` subscriber that writes the events [`Filter`] lets through to stderr, one line
/// each: `LEVEL target: message field=value ...`. Spans are not shown.
pub struct StderrLog {
    filter: Filter,
    next_span: AtomicU64,
}

impl StderrLog {
    /// A log with `filter`.
    pub fn new(filter: Filter) -> StderrLog {
        StderrLog { filter, next_span: AtomicU64::new(1) }
    }

    /// The line an event is written as.
    fn line(&self, event: &Event<'_>) -> String {
        let m = event.metadata();
        let mut line = Line { message: String::new(), fields: String::new() };
        event.record(&mut line);
        format!("{:>5} {}: {}{}\n", m.level(), m.target(), line.message, line.fields)
    }
}

struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            self.fields.push_str(&format!(" {}={value}", field.name()));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message.push_str(&format!("{value:?}"));
        } else {
            self.fields.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

impl tracing::Subscriber for StderrLog {
    fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
        if self.filter.enabled(m.target(), m.level()) { Interest::always() } else { Interest::never() }
    }

    fn enabled(&self, m: &Metadata<'_>) -> bool {
        self.filter.enabled(m.target(), m.level())
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.filter.max())
    }

    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, event: &Event<'_>) {
        // One write per line, so that lines of several threads do not interleave.
        let _ = std::io::stderr().lock().write_all(self.line(event).as_bytes());
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

/// Installs a [`StderrLog`] with `RUST_LOG`'s filter as the process's subscriber, unless the
/// program installed one already. Returns whether it did.
pub fn install() -> bool {
    if tracing::dispatcher::has_been_set() {
        return false;
    }
    tracing::subscriber::set_global_default(StderrLog::new(Filter::from_env())).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_directives_set_levels_by_target_prefix() {
        let f = Filter::parse("");
        assert!(f.enabled("ferrocomm::p2p", &Level::WARN) && !f.enabled("ferrocomm::p2p", &Level::INFO));
        let f = Filter::parse("info, ferrocomm::p2p=debug,ferrocomm=error , hyper=off,mycrate[span]=trace,bad=loud");
        assert!(f.enabled("other", &Level::INFO) && !f.enabled("other", &Level::DEBUG));
        assert!(f.enabled("ferrocomm::p2p::engine", &Level::DEBUG), "the longest prefix decides");
        assert!(!f.enabled("ferrocomm::coll", &Level::WARN) && f.enabled("ferrocomm::coll", &Level::ERROR));
        assert!(!f.enabled("hyper::proto", &Level::ERROR));
        assert!(!f.enabled("mycrate", &Level::DEBUG), "span filters are skipped");
        assert!(!f.enabled("bad", &Level::DEBUG), "an unknown level is skipped");
        assert_eq!(f.max(), LevelFilter::DEBUG);
        let f = Filter::parse("ferrocomm");
        assert!(f.enabled("ferrocomm::x", &Level::TRACE) && !f.enabled("x", &Level::INFO));
    }

    #[test]
    fn events_become_one_line_with_their_fields() {
        let log = StderrLog::new(Filter::parse("trace"));
        let lines = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        struct Capture(StderrLog, std::sync::Arc<parking_lot::Mutex<Vec<String>>>);
        impl tracing::Subscriber for Capture {
            fn enabled(&self, m: &Metadata<'_>) -> bool {
                self.0.enabled(m)
            }
            fn new_span(&self, a: &span::Attributes<'_>) -> span::Id {
                self.0.new_span(a)
            }
            fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
            fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
            fn event(&self, e: &Event<'_>) {
                self.1.lock().push(self.0.line(e));
            }
            fn enter(&self, _: &span::Id) {}
            fn exit(&self, _: &span::Id) {}
        }
        tracing::subscriber::with_default(Capture(log, lines.clone()), || {
            tracing::warn!(target: "ferrocomm::test", peer = 3, why = "gone", "peer lost");
        });
        assert_eq!(lines.lock().as_slice(), [" WARN ferrocomm::test: peer lost peer=3 why=gone\n"]);
    }
}
