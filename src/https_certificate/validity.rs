//! When a certificate expires, read from its DER (RFC 5280 4.1): only the few elements
//! before `validity` are walked, which is all the log line needs; a certificate this
//! cannot read just has no expiry in the line.

/// `notAfter` of the X.509 certificate `der`, as `2027-03-01 12:00:00 UTC`.
pub(super) fn not_after(der: &[u8]) -> Option<String> {
    let (certificate, _) = element(der, SEQUENCE)?;
    let (tbs, _) = element(certificate, SEQUENCE)?;
    let mut rest = tbs;
    // `version`, explicitly tagged [0], is absent from v1 certificates.
    if rest.first() == Some(&VERSION) {
        rest = element(rest, VERSION)?.1;
    }
    rest = element(rest, INTEGER)?.1; // serialNumber
    rest = element(rest, SEQUENCE)?.1; // signature
    rest = element(rest, SEQUENCE)?.1; // issuer
    let (validity, _) = element(rest, SEQUENCE)?;
    let not_before_tag = *validity.first()?;
    let (_, after) = element(validity, not_before_tag)?;
    match *after.first()? {
        UTC_TIME => {
            let time = std::str::from_utf8(element(after, UTC_TIME)?.0).ok()?;
            // Two-digit years: 50–99 are 19xx, 00–49 are 20xx (RFC 5280 4.1.2.5.1).
            let century = if time.get(..2)? >= "50" { "19" } else { "20" };
            format_time(&format!("{century}{time}"))
        }
        GENERALIZED_TIME => {
            format_time(std::str::from_utf8(element(after, GENERALIZED_TIME)?.0).ok()?)
        }
        _ => None,
    }
}

const INTEGER: u8 = 0x02;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;
const SEQUENCE: u8 = 0x30;
const VERSION: u8 = 0xa0;

/// `YYYYMMDDHHMMSSZ` as `YYYY-MM-DD HH:MM:SS UTC`.
fn format_time(time: &str) -> Option<String> {
    if time.len() != 15 || !time.ends_with('Z') || !time[..14].bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!(
        "{}-{}-{} {}:{}:{} UTC",
        &time[..4],
        &time[4..6],
        &time[6..8],
        &time[8..10],
        &time[10..12],
        &time[12..14]
    ))
}

/// The contents of the DER element at the start of `der` if its tag is `tag`, and what
/// follows it.
fn element(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&found, rest) = der.split_first()?;
    if found != tag {
        return None;
    }
    let (&first, mut rest) = rest.split_first()?;
    let length = if first < 0x80 {
        usize::from(first)
    } else {
        // Long form: the low bits say how many length bytes follow (at most 4 here).
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (bytes, after) = rest.split_at(count);
        rest = after;
        bytes
            .iter()
            .fold(0usize, |length, &byte| (length << 8) | usize::from(byte))
    };
    (rest.len() >= length).then(|| rest.split_at(length))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expiry_is_read_from_a_certificate() {
        let mut params = rcgen::CertificateParams::new(vec!["a.test".to_owned()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 7, 9);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            not_after(cert.der()).as_deref(),
            Some("2031-07-09 00:00:00 UTC")
        );
        // Years from 2050 are GeneralizedTime.
        params.not_after = rcgen::date_time_ymd(2061, 1, 2);
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            not_after(cert.der()).as_deref(),
            Some("2061-01-02 00:00:00 UTC")
        );
    }

    #[test]
    fn what_is_not_a_certificate_has_no_expiry() {
        assert_eq!(not_after(b""), None);
        assert_eq!(not_after(&[SEQUENCE, 0x85, 1, 2, 3, 4, 5]), None);
        assert_eq!(not_after(&[SEQUENCE, 0x82, 0xff]), None);
        assert_eq!(not_after(&[SEQUENCE, 2, SEQUENCE, 0]), None);
    }
}
