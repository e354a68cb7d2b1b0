use std::sync::Arc;
use std::time::Duration;

use super::consumer::{FenceRetakes, RETAKE_FIRST, RETAKE_MAX};
use super::*;
use prost::Message as _;
use sluice_proto::v1::{GrantEvent, GrantEventBatch, TicketId};

#[test]
fn a_partition_fenced_again_and_again_is_taken_over_again_ever_later() {
    let mut retakes = FenceRetakes::default();
    let start = tokio::time::Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    assert_eq!(retakes.delay(4, at(0)), Duration::from_millis(500));
    assert_eq!(retakes.delay(4, at(700)), Duration::from_secs(1));
    assert_eq!(retakes.delay(4, at(2_000)), Duration::from_secs(2));
    assert_eq!(retakes.delay(4, at(4_500)), Duration::from_secs(4));
    assert_eq!(retakes.delay(4, at(9_000)), RETAKE_MAX);
    assert_eq!(retakes.delay(4, at(18_000)), RETAKE_MAX);
    // Another partition counts apart; a quiet spell starts over.
    assert_eq!(retakes.delay(5, at(18_000)), RETAKE_FIRST);
    assert_eq!(retakes.delay(4, at(18_000 + 31_000)), RETAKE_FIRST);
}

#[test]
fn outbox_packs_entries_into_decodable_batches_and_splits_by_size() {
    let topic: Arc<str> = Arc::from("grants");
    let mut outbox = Outbox::new();
    for index in 0..100u32 {
        let event = GrantEvent {
            ticket: Some(TicketId {
                job_id: format!("job-{index}"),
                attempt: 1,
                step: index,
            }),
            ..Default::default()
        };
        outbox.push_entry(&topic, i32::try_from(index % 2).unwrap(), &event, 400);
    }
    assert_eq!(outbox.len(), 100);
    let messages = outbox.into_messages();
    assert!(messages.len() > 2, "expected splitting, got {}", messages.len());
    let mut seen = 0;
    for message in messages {
        assert!(message.payload.len() <= 400 + 40);
        let batch = GrantEventBatch::decode(message.payload.as_slice()).unwrap();
        for event in batch.events {
            let step = event.ticket.unwrap().step;
            assert_eq!(i32::try_from(step % 2).unwrap(), message.partition.unwrap());
            seen += 1;
        }
    }
    assert_eq!(seen, 100);
}
