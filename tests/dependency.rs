//! ferrocomm as a dependency sees it: settings made with the builder (the struct is
//! `#[non_exhaustive]`), and errors that keep the error of the layer below, typed.

use std::time::Duration;

use ferrocomm::bootstrap::kv::KvError;
use ferrocomm::{Error, ProgressMode, Settings, TcpBackend, TransportChoice};

/// The builder sets what it is told and keeps the rest: the defaults, or the settings it started
/// from.
#[test]
fn the_builder_sets_fields_and_keeps_the_rest() {
    let s = Settings::builder()
        .transports(TransportChoice::Tcp)
        .tcp_backend(TcpBackend::Portable)
        .progress(ProgressMode::BusyPoll)
        .eager_limit(4096)
        .connect_timeout(Duration::from_millis(1500))
        .build();
    let mut by_hand = Settings::default();
    by_hand.transports = TransportChoice::Tcp;
    by_hand.tcp_backend = TcpBackend::Portable;
    by_hand.progress = ProgressMode::BusyPoll;
    by_hand.eager_limit = 4096;
    by_hand.connect_timeout = Duration::from_millis(1500);
    assert_eq!(format!("{s:?}"), format!("{by_hand:?}"));
    let again = s.clone().into_builder().max_credit(7).build();
    assert_eq!((again.max_credit, again.eager_limit, again.transports), (7, 4096, TransportChoice::Tcp));
    // `build` does not check; `validate` (and `init_with`) does.
    let bad = Settings::builder().max_credit(0).build();
    assert!(matches!(bad.validate(), Err(Error::Config { name: "max_credit", .. })));
}

/// A rank that cannot reach its store fails with `Error::Bootstrap` saying what it was doing,
/// and the store client's own error, typed, as its source.
#[tokio::test]
async fn a_bootstrap_failure_keeps_its_typed_cause() {
    // A port with nothing listening on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let settings = Settings::builder().connect_timeout(Duration::from_millis(300)).build();
    let err = ferrocomm::bootstrap::join(0, 2, &format!("127.0.0.1:{port}"), [7; 32], None, settings)
        .await
        .map(drop)
        .unwrap_err();
    let Error::Bootstrap { what, .. } = &err else { panic!("not a bootstrap error: {err:?}") };
    assert_eq!(what, "connecting to the key-value store");
    let cause = std::error::Error::source(&err).expect("the store client's error");
    let kv = cause.downcast_ref::<KvError>().unwrap_or_else(|| panic!("not a KvError: {cause:?}"));
    assert!(matches!(kv, KvError::ConnectTimeout { .. }), "{kv:?}");
    // The message says both.
    let text = err.to_string();
    assert!(text.starts_with("bootstrap failed: connecting to the key-value store: "), "{text}");
    assert!(text.contains(&port.to_string()), "{text}");
}
