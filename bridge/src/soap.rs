//! SOAP over HTTP/1.1: `POST /soap` (SOAP 1.1 or 1.2, document/literal), `GET /soap?wsdl`.
//!
//! The request's Body holds `Submit` with one `Message`: the canonical XML bytes of one
//! message as `xs:base64Binary` — inline, or in an MTOM/XOP attachment that an `xop:Include`
//! references, which spares base64's third. The Header holds `Auth`: the `Participant` and the
//! hex HMAC-SHA256 `Signature` of those bytes under its key. The answer comes after the commit
//! that holds the message: `SubmitResponse` with `Status` ACCEPTED or DUPLICATE, or a SOAP Fault
//! whose faultstring (SOAP 1.2: Reason) starts with the reason code and whose detail holds a
//! `Rejection` with the `Code`. A request that is not a SOAP envelope with a message is still
//! recorded by the engine (as an exception, E_PARSE) and answered with a Fault.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use quick_xml::events::Event;
use ste_engine::pipeline::{AckResult, Envelope};
use ste_engine::reason::{ReasonCode, Rejection};
use ste_engine::sign::SIGNATURE_LEN;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::gateway::{GatewayHandle, Reply};
use crate::listener::accept_loop;

/// The namespace of the bridge's SOAP elements.
pub const BRIDGE_NS: &str = "urn:ste:bridge:1";
/// SOAP 1.1 envelope namespace.
pub const SOAP11_NS: &str = "http://schemas.xmlsoap.org/soap/envelope/";
/// SOAP 1.2 envelope namespace.
pub const SOAP12_NS: &str = "http://www.w3.org/2003/05/soap-envelope";
/// XOP namespace.
const XOP_NS: &str = "http://www.w3.org/2004/08/xop/include";
/// Elements deeper than this are refused (the envelope needs five levels).
const DEPTH_MAX: usize = 16;

/// Limits of the SOAP listener.
#[derive(Debug, Clone)]
pub struct SoapConfig {
    /// Connections served at once: in all, from one source, and not yet authenticated.
    pub connections: crate::listener::ConnectionLimits,
    /// TLS for every connection, when set.
    pub tls: Option<crate::tls::Tls>,
    /// Largest request body; a longer declared or sent body is refused with 413.
    pub max_body_bytes: usize,
    /// Time allowed to send a request's headers (and to start the next one on a kept-alive
    /// connection).
    pub header_timeout: Duration,
    /// Time allowed to send a request's body.
    pub body_timeout: Duration,
}

impl SoapConfig {
    fn accepting(&self) -> crate::listener::Accepting {
        crate::listener::Accepting {
            tls: self.tls.as_ref().map(|tls| tls.0.clone()),
            handshake_timeout: self.header_timeout,
            ..crate::listener::Accepting::plain(self.connections)
        }
    }
}

impl Default for SoapConfig {
    fn default() -> Self {
        Self {
            connections: crate::listener::ConnectionLimits::default(),
            tls: None,
            max_body_bytes: 1024 * 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// The SOAP version of a request, which its answer uses too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoapVersion {
    V11,
    V12,
}

impl SoapVersion {
    fn namespace(self) -> &'static str {
        match self {
            SoapVersion::V11 => SOAP11_NS,
            SoapVersion::V12 => SOAP12_NS,
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            SoapVersion::V11 => "text/xml; charset=utf-8",
            SoapVersion::V12 => "application/soap+xml; charset=utf-8",
        }
    }
}

/// What a SOAP request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoapRequest {
    pub version: SoapVersion,
    pub participant: Option<String>,
    pub signature: Option<[u8; SIGNATURE_LEN]>,
    pub message: Vec<u8>,
}

/// Why a request carries no message (answered with a Fault, recorded as E_PARSE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoapError {
    pub version: SoapVersion,
    pub code: ReasonCode,
    pub detail: String,
}

impl SoapError {
    fn parse(version: SoapVersion, detail: impl Into<String>) -> Self {
        Self {
            version,
            code: ReasonCode::Parse,
            detail: detail.into(),
        }
    }
}

/// Where the reader is in the envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Participant,
    Signature,
    Message,
    Other,
}

/// Namespace declarations a request may make in all: an envelope needs a handful.
pub const NAMESPACE_DECLARATIONS_MAX: usize = 64;
/// Elements a request may hold: an envelope needs about ten.
pub const ELEMENTS_MAX: usize = 256;
/// Attributes one element may carry.
pub const ATTRIBUTES_PER_ELEMENT_MAX: usize = 16;

/// The namespace bindings in scope, declared by the open elements. Bounded by
/// [`NAMESPACE_DECLARATIONS_MAX`], so resolving a name costs a short scan whatever the request.
#[derive(Default)]
struct Scopes {
    /// (prefix, "" for the default namespace; namespace URI; depth of the declaring element)
    bindings: Vec<(String, String, usize)>,
    declared: usize,
}

impl Scopes {
    fn resolve(&self, prefix: &str) -> &str {
        self.bindings
            .iter()
            .rev()
            .find(|(bound, _, _)| bound == prefix)
            .map_or("", |(_, namespace, _)| namespace.as_str())
    }

    /// Ends the scope of the bindings declared at `depth` or deeper.
    fn close(&mut self, depth: usize) {
        while self.bindings.last().is_some_and(|(_, _, at)| *at >= depth) {
            self.bindings.pop();
        }
    }
}

/// The text of the slot being read, in pieces (text, references, CDATA).
fn push_piece(text: &mut String, piece: &str, limit: usize) -> Result<(), String> {
    if text.len() + piece.len() > limit {
        return Err("an element's text is longer than the request allows".into());
    }
    text.push_str(piece);
    Ok(())
}

/// Parses a SOAP envelope (`attachments` by Content-ID, for MTOM). No DOCTYPE, no entity but
/// the predefined ones, at most [`DEPTH_MAX`] levels, [`ELEMENTS_MAX`] elements,
/// [`ATTRIBUTES_PER_ELEMENT_MAX`] attributes an element and [`NAMESPACE_DECLARATIONS_MAX`]
/// namespace declarations, each checked as the parser goes: the cost of a request is linear in
/// its size, whatever it holds.
pub fn parse_envelope(
    body: &[u8],
    attachments: &HashMap<String, Bytes>,
) -> Result<SoapRequest, SoapError> {
    let mut version: Option<SoapVersion> = None;
    let fail = |version: Option<SoapVersion>, detail: String| {
        SoapError::parse(version.unwrap_or(SoapVersion::V11), detail)
    };
    let text =
        std::str::from_utf8(body).map_err(|_| fail(None, "the envelope is not UTF-8".into()))?;
    let mut reader = quick_xml::Reader::from_str(text);
    reader.config_mut().check_end_names = true;
    let mut scopes = Scopes::default();
    let mut elements = 0_usize;
    // (namespace, local name) of the open elements.
    let mut path: Vec<(String, String)> = Vec::new();
    let mut slot = Slot::Other;
    let mut slot_text = String::new();
    let (mut participant, mut signature_hex, mut message) = (None, None, None::<Vec<u8>>);
    loop {
        let event = reader
            .read_event()
            .map_err(|error| fail(version, format!("not well-formed xml: {error}")))?;
        let is_empty = matches!(event, Event::Empty(_));
        match event {
            Event::DocType(_) => return Err(fail(version, "a DOCTYPE is not allowed".into())),
            Event::Start(start) | Event::Empty(start) => {
                elements += 1;
                if elements > ELEMENTS_MAX {
                    return Err(fail(
                        version,
                        format!("the envelope holds more than {ELEMENTS_MAX} elements"),
                    ));
                }
                if path.len() >= DEPTH_MAX {
                    return Err(fail(version, "the envelope is nested too deeply".into()));
                }
                let depth = path.len();
                for (index, attribute) in start.attributes().enumerate() {
                    if index >= ATTRIBUTES_PER_ELEMENT_MAX {
                        return Err(fail(
                            version,
                            format!("an element carries more than {ATTRIBUTES_PER_ELEMENT_MAX} attributes"),
                        ));
                    }
                    let attribute = attribute
                        .map_err(|error| fail(version, format!("bad attribute: {error}")))?;
                    let key = attribute.key.as_ref();
                    let prefix = match key.strip_prefix("xmlns") {
                        Some("") => "",
                        Some(rest) => match rest.strip_prefix(':') {
                            Some(prefix) => prefix,
                            None => continue,
                        },
                        None => continue,
                    };
                    scopes.declared += 1;
                    if scopes.declared > NAMESPACE_DECLARATIONS_MAX {
                        return Err(fail(
                            version,
                            format!("the envelope declares more than {NAMESPACE_DECLARATIONS_MAX} namespaces"),
                        ));
                    }
                    let value = attribute
                        .normalized_value(quick_xml::XmlVersion::Implicit1_0)
                        .map_err(|error| {
                            fail(version, format!("bad namespace declaration: {error}"))
                        })?;
                    scopes
                        .bindings
                        .push((prefix.to_owned(), value.into_owned(), depth));
                }
                let name = start.name();
                let prefix = name.prefix().map_or("", |p| p.into_inner());
                let namespace = scopes.resolve(prefix).to_owned();
                let local = start.local_name().as_ref().to_owned();
                if depth == 0 {
                    version = match (namespace.as_str(), local.as_str()) {
                        (SOAP11_NS, "Envelope") => Some(SoapVersion::V11),
                        (SOAP12_NS, "Envelope") => Some(SoapVersion::V12),
                        _ => {
                            return Err(fail(
                                None,
                                "the root element is not a SOAP Envelope".into(),
                            ))
                        }
                    };
                }
                let in_bridge = namespace == BRIDGE_NS;
                slot = match (depth, local.as_str()) {
                    (3, "Participant") if in_bridge && under(&path, "Header", "Auth") => {
                        Slot::Participant
                    }
                    (3, "Signature") if in_bridge && under(&path, "Header", "Auth") => {
                        Slot::Signature
                    }
                    (3, "Message") if in_bridge && under(&path, "Body", "Submit") => Slot::Message,
                    (4, "Include")
                        if namespace == XOP_NS
                            && path.last().is_some_and(|(_, l)| l == "Message") =>
                    {
                        let href = start
                            .try_get_attribute("href")
                            .ok()
                            .flatten()
                            .map(|a| a.value.into_owned())
                            .ok_or_else(|| fail(version, "xop:Include without href".into()))?;
                        let id = content_id(&href);
                        let part = attachments.get(&id).ok_or_else(|| {
                            fail(version, format!("xop:Include names no attachment ({href})"))
                        })?;
                        message = Some(part.to_vec());
                        Slot::Other
                    }
                    _ => Slot::Other,
                };
                slot_text.clear();
                if is_empty {
                    slot = Slot::Other;
                    scopes.close(depth);
                } else {
                    path.push((namespace, local));
                }
            }
            Event::End(_) => {
                let text = slot_text.trim();
                match slot {
                    Slot::Participant => participant = Some(text.to_owned()),
                    Slot::Signature => signature_hex = Some(text.to_owned()),
                    Slot::Message => {
                        let compact: Vec<u8> =
                            text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
                        let decoded = base64::engine::general_purpose::STANDARD
                            .decode(compact)
                            .map_err(|error| {
                                fail(version, format!("Message is not base64: {error}"))
                            })?;
                        message = Some(decoded);
                    }
                    Slot::Other => {}
                }
                slot_text.clear();
                path.pop();
                scopes.close(path.len());
                slot = Slot::Other;
            }
            Event::Text(text) if slot != Slot::Other => {
                push_piece(&mut slot_text, &text.xml10_content(), body.len())
                    .map_err(|detail| fail(version, detail))?;
            }
            Event::CData(data) if slot != Slot::Other => {
                push_piece(&mut slot_text, &data.xml10_content(), body.len())
                    .map_err(|detail| fail(version, detail))?;
            }
            Event::GeneralRef(reference) => {
                let resolved = match reference
                    .resolve_char_ref()
                    .map_err(|error| fail(version, format!("bad character reference: {error}")))?
                {
                    Some(ch) => ch.to_string(),
                    None => quick_xml::escape::resolve_predefined_entity(&reference)
                        .map(str::to_owned)
                        .ok_or_else(|| {
                            fail(version, format!("undeclared entity &{};", &*reference))
                        })?,
                };
                if slot != Slot::Other {
                    push_piece(&mut slot_text, &resolved, body.len())
                        .map_err(|detail| fail(version, detail))?;
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    let version = version.ok_or_else(|| fail(None, "empty request".into()))?;
    let message =
        message.ok_or_else(|| SoapError::parse(version, "no Submit/Message in the Body"))?;
    let signature = match signature_hex {
        Some(hex_text) => {
            let bytes = hex::decode(&hex_text)
                .ok()
                .and_then(|b| <[u8; SIGNATURE_LEN]>::try_from(b).ok());
            // A signature that is not 32 hex bytes is a wrong signature: E_SIG from the validator.
            Some(bytes.unwrap_or([0; SIGNATURE_LEN]))
        }
        None => None,
    };
    Ok(SoapRequest {
        version,
        participant,
        signature,
        message,
    })
}

/// Whether the open elements are `Envelope / outer / inner` (outer in the SOAP namespace).
fn under(path: &[(String, String)], outer: &str, inner: &str) -> bool {
    path.len() == 3
        && path[1].1 == outer
        && (path[1].0 == SOAP11_NS || path[1].0 == SOAP12_NS)
        && path[2].1 == inner
        && path[2].0 == BRIDGE_NS
}

/// The Content-ID an `href="cid:…"` names, as the part's `Content-ID: <…>` header gives it.
fn content_id(href: &str) -> String {
    let id = href.strip_prefix("cid:").unwrap_or(href);
    percent_decode(id)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(byte) = u8::from_str_radix(hex, 16) {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn escape(text: &str) -> String {
    quick_xml::escape::escape(text).into_owned()
}

/// The answer to an accepted or duplicate message.
pub fn ack_envelope(version: SoapVersion, duplicate: bool) -> String {
    let status = if duplicate { "DUPLICATE" } else { "ACCEPTED" };
    format!(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?><soap:Envelope xmlns:soap=\"{}\"><soap:Body><ste:SubmitResponse xmlns:ste=\"{BRIDGE_NS}\"><ste:Status>{status}</ste:Status></ste:SubmitResponse></soap:Body></soap:Envelope>",
        version.namespace()
    )
}

/// The Fault of a rejected message: the reason code first in the fault string, and in the
/// detail's `Rejection`.
pub fn fault_envelope(version: SoapVersion, code: ReasonCode, detail: &str) -> String {
    let text = if detail.is_empty() {
        code.as_str().to_owned()
    } else {
        format!("{code}: {}", escape(detail))
    };
    let rejection = format!(
        "<ste:Rejection xmlns:ste=\"{BRIDGE_NS}\"><ste:Code>{code}</ste:Code><ste:Detail>{}</ste:Detail></ste:Rejection>",
        escape(detail)
    );
    let fault = match version {
        SoapVersion::V11 => format!(
            "<soap:Fault><faultcode>soap:Client</faultcode><faultstring>{text}</faultstring><detail>{rejection}</detail></soap:Fault>"
        ),
        SoapVersion::V12 => format!(
            "<soap:Fault><soap:Code><soap:Value>soap:Sender</soap:Value></soap:Code><soap:Reason><soap:Text xml:lang=\"en\">{text}</soap:Text></soap:Reason><soap:Detail>{rejection}</soap:Detail></soap:Fault>"
        ),
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?><soap:Envelope xmlns:soap=\"{}\"><soap:Body>{fault}</soap:Body></soap:Envelope>",
        version.namespace()
    )
}

/// The WSDL (with its XSD) of the service at `location`.
pub fn wsdl(location: &str) -> String {
    let location = escape(location);
    const TRADE_NS: &str = ste_engine::codec::NAMESPACE;
    // The same document/literal binding for SOAP 1.1 (prefix soap) and 1.2 (prefix soap12).
    let bindings: String = [("STESoap11", "soap"), ("STESoap12", "soap12")]
        .iter()
        .map(|(name, ns)| {
            format!(
                r#"  <binding name="{name}" type="tns:STEPortType">
    <{ns}:binding style="document" transport="http://schemas.xmlsoap.org/soap/http"/>
    <operation name="Submit">
      <{ns}:operation soapAction="{BRIDGE_NS}#Submit" style="document"/>
      <input>
        <{ns}:header message="tns:AuthHeader" part="Auth" use="literal"/>
        <{ns}:body parts="parameters" use="literal"/>
      </input>
      <output><{ns}:body use="literal"/></output>
      <fault name="Rejection"><{ns}:fault name="Rejection" use="literal"/></fault>
    </operation>
  </binding>
"#
            )
        })
        .collect();
    let msg_fields: String = ste_engine::codec::Field::ALL
        .iter()
        .map(|field| {
            format!(
                "            <xsd:element name=\"{}\" type=\"xsd:string\" minOccurs=\"0\"/>\n",
                field.name()
            )
        })
        .collect();
    format!(
        r#"<?xml version="1.0" encoding="utf-8"?>
<definitions name="STE" targetNamespace="{BRIDGE_NS}"
    xmlns="http://schemas.xmlsoap.org/wsdl/"
    xmlns:tns="{BRIDGE_NS}"
    xmlns:xsd="http://www.w3.org/2001/XMLSchema"
    xmlns:soap="http://schemas.xmlsoap.org/wsdl/soap/"
    xmlns:soap12="http://schemas.xmlsoap.org/wsdl/soap12/">
  <documentation>STE trade matching: submit one signed trade message (NOE, ALC, NPR or SET in
  the canonical XML of namespace urn:ste:trade:1). The answer comes after the message is
  committed: ACCEPTED or DUPLICATE, or a Fault whose Rejection carries the reason code.</documentation>
  <types>
    <xsd:schema targetNamespace="{BRIDGE_NS}" elementFormDefault="qualified">
      <xsd:element name="Auth">
        <xsd:annotation><xsd:documentation>The participant and the hex HMAC-SHA256 of the Message bytes under its key.</xsd:documentation></xsd:annotation>
        <xsd:complexType>
          <xsd:sequence>
            <xsd:element name="Participant" type="xsd:string"/>
            <xsd:element name="Signature" type="xsd:string"/>
          </xsd:sequence>
        </xsd:complexType>
      </xsd:element>
      <xsd:element name="Submit">
        <xsd:complexType>
          <xsd:sequence>
            <xsd:element name="Message" type="xsd:base64Binary"/>
          </xsd:sequence>
        </xsd:complexType>
      </xsd:element>
      <xsd:simpleType name="Status">
        <xsd:restriction base="xsd:string">
          <xsd:enumeration value="ACCEPTED"/>
          <xsd:enumeration value="DUPLICATE"/>
        </xsd:restriction>
      </xsd:simpleType>
      <xsd:element name="SubmitResponse">
        <xsd:complexType>
          <xsd:sequence>
            <xsd:element name="Status" type="tns:Status"/>
          </xsd:sequence>
        </xsd:complexType>
      </xsd:element>
      <xsd:element name="Rejection">
        <xsd:complexType>
          <xsd:sequence>
            <xsd:element name="Code" type="xsd:string"/>
            <xsd:element name="Detail" type="xsd:string"/>
          </xsd:sequence>
        </xsd:complexType>
      </xsd:element>
    </xsd:schema>
    <xsd:schema targetNamespace="{TRADE_NS}" elementFormDefault="qualified">
      <xsd:annotation><xsd:documentation>The canonical trade message that Submit/Message carries as bytes (signed as they are): one Msg whose children come in any order; which are mandatory depends on its Type (NOE, ALC, NPR, SET) and Function (NEW, CAN, AMD).</xsd:documentation></xsd:annotation>
      <xsd:element name="Msg">
        <xsd:complexType>
          <xsd:all>
{msg_fields}          </xsd:all>
        </xsd:complexType>
      </xsd:element>
    </xsd:schema>
  </types>
  <message name="SubmitRequest"><part name="parameters" element="tns:Submit"/></message>
  <message name="SubmitResponse"><part name="parameters" element="tns:SubmitResponse"/></message>
  <message name="AuthHeader"><part name="Auth" element="tns:Auth"/></message>
  <message name="RejectionFault"><part name="Rejection" element="tns:Rejection"/></message>
  <portType name="STEPortType">
    <operation name="Submit">
      <input message="tns:SubmitRequest"/>
      <output message="tns:SubmitResponse"/>
      <fault name="Rejection" message="tns:RejectionFault"/>
    </operation>
  </portType>
{bindings}  <service name="STE">
    <port name="STESoap11" binding="tns:STESoap11"><soap:address location="{location}"/></port>
    <port name="STESoap12" binding="tns:STESoap12"><soap12:address location="{location}"/></port>
  </service>
</definitions>
"#
    )
}

type Body = Full<Bytes>;

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(value) = HeaderValue::from_str(content_type) {
        response.headers_mut().insert(CONTENT_TYPE, value);
    }
    response
}

fn fault_response(version: SoapVersion, code: ReasonCode, detail: &str) -> Response<Body> {
    // SOAP 1.1 answers every Fault with 500; SOAP 1.2 a Sender fault with 400.
    let status = match version {
        SoapVersion::V11 => StatusCode::INTERNAL_SERVER_ERROR,
        SoapVersion::V12 => StatusCode::BAD_REQUEST,
    };
    respond(
        status,
        version.content_type(),
        fault_envelope(version, code, detail),
    )
}

/// The SOAP version a request's Content-Type announces (for answers before the body is read).
fn version_of(request: &Request<Incoming>) -> SoapVersion {
    let content_type = request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type.contains("application/soap+xml") {
        SoapVersion::V12
    } else {
        SoapVersion::V11
    }
}

/// Splits an MTOM/XOP `multipart/related` body into its root part and its attachments by
/// Content-ID.
pub async fn split_multipart(
    content_type: &str,
    body: Bytes,
) -> Result<(Bytes, HashMap<String, Bytes>), String> {
    // multer's own boundary parser accepts multipart/form-data only; the parameters of
    // multipart/related are read here.
    let parameter = |name: &str| {
        content_type
            .split(';')
            .filter_map(|p| p.trim().split_once('='))
            .find(|(key, _)| key.trim().eq_ignore_ascii_case(name))
            .map(|(_, value)| value.trim().trim_matches('"').to_owned())
    };
    let boundary = parameter("boundary").ok_or("no boundary in the Content-Type")?;
    let start =
        parameter("start").map(|v| v.trim_start_matches('<').trim_end_matches('>').to_owned());
    let stream = futures_util::stream::once(async move { Ok::<Bytes, Infallible>(body) });
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut root: Option<Bytes> = None;
    let mut parts = HashMap::new();
    while let Some(field) = multipart.next_field().await.map_err(|e| e.to_string())? {
        let id = field
            .headers()
            .get("content-id")
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.trim()
                    .trim_start_matches('<')
                    .trim_end_matches('>')
                    .to_owned()
            });
        let bytes = field.bytes().await.map_err(|e| e.to_string())?;
        let is_root = match (&start, &id) {
            (Some(start), Some(id)) => start == id,
            _ => root.is_none(),
        };
        if is_root && root.is_none() {
            root = Some(bytes);
        } else if let Some(id) = id {
            parts.insert(id, bytes);
        }
    }
    let root = root.ok_or("the multipart request has no root part")?;
    Ok((root, parts))
}

struct Service {
    gateway: GatewayHandle,
    config: SoapConfig,
    /// Envelopes parsed at once, off the async workers (which also serve framed XML and FIX).
    parsers: Arc<tokio::sync::Semaphore>,
}

/// Envelopes parsed at once: one per core of the machine this was sized for. A parse is linear
/// in the body and bounded by the caps above, but a 1 MiB body still takes milliseconds, and
/// it must not take them from the threads that move every other connection's bytes.
pub const PARSERS_MAX: usize = 2;

/// Parses an envelope on the blocking pool, at most [`PARSERS_MAX`] at a time.
async fn parse_off_the_workers(
    parsers: &tokio::sync::Semaphore,
    version: SoapVersion,
    root: Bytes,
    parts: HashMap<String, Bytes>,
) -> Result<SoapRequest, SoapError> {
    let Ok(_permit) = parsers.acquire().await else {
        return Err(SoapError::parse(version, "the engine is shutting down"));
    };
    tokio::task::spawn_blocking(move || parse_envelope(&root, &parts))
        .await
        .unwrap_or_else(|_| Err(SoapError::parse(version, "the envelope parser failed")))
}

impl Service {
    async fn handle(
        &self,
        request: Request<Incoming>,
        admission: &crate::listener::Admission,
    ) -> Response<Body> {
        if request.uri().path() != "/soap" {
            return respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                "only /soap is served here\n",
            );
        }
        if request.method() == Method::GET {
            if request
                .uri()
                .query()
                .is_some_and(|q| q.eq_ignore_ascii_case("wsdl"))
            {
                let host = request
                    .headers()
                    .get(hyper::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .unwrap_or("127.0.0.1")
                    .to_owned();
                let scheme = if self.config.tls.is_some() {
                    "https"
                } else {
                    "http"
                };
                return respond(
                    StatusCode::OK,
                    "text/xml; charset=utf-8",
                    wsdl(&format!("{scheme}://{host}/soap")),
                );
            }
            return respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                "GET /soap?wsdl for the WSDL\n",
            );
        }
        if request.method() != Method::POST {
            return respond(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "POST a SOAP envelope\n",
            );
        }
        let version = version_of(&request);
        let declared = request
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|length| length > self.config.max_body_bytes as u64) {
            let mut response = too_large(version, self.config.max_body_bytes);
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
            return response;
        }
        let content_type = request
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let limited = Limited::new(request.into_body(), self.config.max_body_bytes);
        let body = match tokio::time::timeout(self.config.body_timeout, limited.collect()).await {
            Err(_) => {
                let mut response = respond(
                    StatusCode::REQUEST_TIMEOUT,
                    "text/plain",
                    "the request body did not arrive in time\n",
                );
                response
                    .headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
            Ok(Err(_)) => {
                let mut response = too_large(version, self.config.max_body_bytes);
                response
                    .headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
                return response;
            }
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        let parsed = if content_type
            .to_ascii_lowercase()
            .starts_with("multipart/related")
        {
            match split_multipart(&content_type, body.clone()).await {
                Ok((root, parts)) => {
                    parse_off_the_workers(&self.parsers, version, root, parts).await
                }
                Err(detail) => Err(SoapError::parse(
                    version,
                    format!("bad MTOM request: {detail}"),
                )),
            }
        } else {
            parse_off_the_workers(&self.parsers, version, body.clone(), HashMap::new()).await
        };
        let (version, envelope) = match parsed {
            Ok(request) => {
                // A request signed by the participant it names authenticates its connection,
                // and goes at that participant's rate.
                if let (Some(participant), Some(signature)) =
                    (request.participant.as_deref(), request.signature.as_ref())
                {
                    if self
                        .gateway
                        .signed_by(participant, &request.message, signature)
                    {
                        if let Err(why) = admission.authenticated_as(participant) {
                            return respond(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "text/plain",
                                format!("E_BUSY {why}\n"),
                            );
                        }
                        self.gateway.pace(participant).await;
                    }
                }
                let refusal = request.participant.as_deref().and_then(|participant| {
                    request.signature.and_then(|signature| {
                        self.gateway
                            .impersonation(participant, &request.message, &signature)
                    })
                });
                (
                    request.version,
                    Envelope {
                        bytes: request.message,
                        sender: request.participant.map(ste_engine::model::Text::from),
                        signature: request.signature,
                        correlation: 0,
                        origin: 0,
                        injected_ns: 0,
                        refusal,
                    },
                )
            }
            // Not a message: recorded all the same, raw, as an exception.
            Err(error) => (
                error.version,
                Envelope {
                    bytes: body.to_vec(),
                    sender: None,
                    signature: None,
                    correlation: 0,
                    origin: 0,
                    injected_ns: 0,
                    refusal: Some(Rejection::new(error.code, error.detail)),
                },
            ),
        };
        let detail = envelope.refusal.as_ref().map(|r| r.detail.clone());
        let (tx, mut rx) = mpsc::channel::<Reply>(1);
        if self.gateway.submit(envelope, 0, &tx).await.is_err() {
            return respond(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "the engine is shutting down\n",
            );
        }
        drop(tx);
        match rx.recv().await.map(|reply| reply.result) {
            Some(AckResult::Accepted) => respond(
                StatusCode::OK,
                version.content_type(),
                ack_envelope(version, false),
            ),
            Some(AckResult::Duplicate) => respond(
                StatusCode::OK,
                version.content_type(),
                ack_envelope(version, true),
            ),
            Some(AckResult::Rejected(code)) => {
                fault_response(version, code, detail.as_deref().unwrap_or(""))
            }
            None => respond(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "the engine stopped before answering\n",
            ),
        }
    }
}

fn too_large(version: SoapVersion, max: usize) -> Response<Body> {
    let mut response = fault_response(
        version,
        ReasonCode::Size,
        &format!("the request is larger than {max} bytes"),
    );
    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    response
}

/// Serves SOAP until `shutdown` turns true, then lets every connection finish the request it
/// is in and closes it.
pub async fn serve(
    listener: TcpListener,
    gateway: GatewayHandle,
    config: SoapConfig,
    shutdown: watch::Receiver<bool>,
) {
    let accepting = config.accepting();
    let service = Arc::new(Service {
        gateway,
        config,
        parsers: Arc::new(tokio::sync::Semaphore::new(PARSERS_MAX)),
    });
    let refusal = |why: &str| {
        format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\nE_BUSY {why}\n",
            why.len() + 8
        )
        .into_bytes()
    };
    let stop = shutdown.clone();
    accept_loop(
        listener,
        "SOAP",
        accepting,
        shutdown,
        refusal,
        move |stream, admission: crate::listener::Admission| {
            let (handler, mut stop) = (service.clone(), stop.clone());
            async move {
                let header_timeout = handler.config.header_timeout;
                let connection =
                    http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(header_timeout)
                        .keep_alive(true)
                        .max_buf_size(64 * 1024)
                        .serve_connection(
                            TokioIo::new(stream),
                            service_fn(move |request| {
                                let (handler, admission) = (handler.clone(), admission.clone());
                                async move {
                                    Ok::<_, Infallible>(handler.handle(request, &admission).await)
                                }
                            }),
                        );
                tokio::pin!(connection);
                tokio::select! {
                    _ = connection.as_mut() => {}
                    _ = stop.changed() => {
                        connection.as_mut().graceful_shutdown();
                        let _ = connection.as_mut().await;
                    }
                }
            }
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(ns: &str, body: &str) -> String {
        format!(
            "<s:Envelope xmlns:s=\"{ns}\" xmlns:b=\"{BRIDGE_NS}\"><s:Header><b:Auth><b:Participant>BRKAAU21XXX</b:Participant><b:Signature>{}</b:Signature></b:Auth></s:Header><s:Body><b:Submit>{body}</b:Submit></s:Body></s:Envelope>",
            "ab".repeat(32)
        )
    }

    #[test]
    fn both_versions_inline_and_xop() {
        let inline = envelope(SOAP11_NS, "<b:Message>PE1zZy8+</b:Message>");
        let parsed = parse_envelope(inline.as_bytes(), &HashMap::new()).expect("parses");
        assert_eq!(parsed.version, SoapVersion::V11);
        assert_eq!(parsed.message, b"<Msg/>");
        assert_eq!(parsed.participant.as_deref(), Some("BRKAAU21XXX"));
        assert_eq!(parsed.signature, Some([0xab; 32]));

        let xop = envelope(
            SOAP12_NS,
            &format!("<b:Message><x:Include xmlns:x=\"{XOP_NS}\" href=\"cid:m%401\"/></b:Message>"),
        );
        let parts = HashMap::from([("m@1".to_owned(), Bytes::from_static(b"<Msg/>"))]);
        let parsed = parse_envelope(xop.as_bytes(), &parts).expect("parses");
        assert_eq!(parsed.version, SoapVersion::V12);
        assert_eq!(parsed.message, b"<Msg/>");
    }

    #[test]
    fn hostile_envelopes_are_parse_errors() {
        let doctype = format!(
            "<!DOCTYPE x [<!ENTITY a \"aaaa\">]>{}",
            envelope(SOAP11_NS, "<b:Message>&a;</b:Message>")
        );
        let error = parse_envelope(doctype.as_bytes(), &HashMap::new()).expect_err("refused");
        assert!(error.detail.contains("DOCTYPE"), "{error:?}");
        let entity = envelope(SOAP11_NS, "<b:Message>&a;</b:Message>");
        assert!(parse_envelope(entity.as_bytes(), &HashMap::new()).is_err());
        let deep = format!(
            "<s:Envelope xmlns:s=\"{SOAP11_NS}\">{}{}</s:Envelope>",
            "<a>".repeat(40),
            "</a>".repeat(40)
        );
        let error = parse_envelope(deep.as_bytes(), &HashMap::new()).expect_err("refused");
        assert!(error.detail.contains("deeply"), "{error:?}");
        let no_message = envelope(SOAP11_NS, "");
        assert!(parse_envelope(no_message.as_bytes(), &HashMap::new()).is_err());
        let missing = envelope(SOAP11_NS, "<b:Message><x:Include xmlns:x=\"http://www.w3.org/2004/08/xop/include\" href=\"cid:nothing\"/></b:Message>");
        assert!(parse_envelope(missing.as_bytes(), &HashMap::new()).is_err());
    }

    #[test]
    fn floods_are_refused_as_the_parser_meets_them() {
        // Namespace declarations: over the cap on one element, or spread over many.
        let declarations: String = (0..=NAMESPACE_DECLARATIONS_MAX)
            .map(|i| format!(" xmlns:p{i}=\"urn:p{i}\""))
            .collect();
        let one_tag = format!("<s:Envelope xmlns:s=\"{SOAP11_NS}\"{declarations}/>");
        let error = parse_envelope(one_tag.as_bytes(), &HashMap::new()).expect_err("refused");
        assert!(error.detail.contains("attributes"), "{error:?}");
        let spread: String = (0..=NAMESPACE_DECLARATIONS_MAX)
            .map(|i| format!("<x xmlns:p{i}=\"urn:p{i}\"/>"))
            .collect();
        let error = parse_envelope(envelope(SOAP11_NS, &spread).as_bytes(), &HashMap::new())
            .expect_err("refused");
        assert!(error.detail.contains("namespaces"), "{error:?}");
        // Elements: many empty children.
        let children = "<x/>".repeat(ELEMENTS_MAX);
        let error = parse_envelope(envelope(SOAP11_NS, &children).as_bytes(), &HashMap::new())
            .expect_err("refused");
        assert!(error.detail.contains("elements"), "{error:?}");
        // A scope ends with its element: redeclaring the same prefix in siblings stays in bounds
        // of the total, and a prefix declared on a sibling does not leak.
        let leaked = envelope(
            SOAP11_NS,
            "<x xmlns:q=\"urn:q\"/><q:Message xmlns:z=\"urn:z\">AAAA</q:Message>",
        );
        let error = parse_envelope(leaked.as_bytes(), &HashMap::new()).expect_err("no message");
        assert!(error.detail.contains("no Submit/Message"), "{error:?}");
    }

    #[test]
    fn text_in_pieces_and_references_make_one_value() {
        let line = b"<Msg/>";
        let encoded = base64::engine::general_purpose::STANDARD.encode(line);
        // A character reference splits the text into pieces; they are joined.
        let split = format!(
            "{}&#x{:x};{}",
            &encoded[..2],
            encoded.as_bytes()[2],
            &encoded[3..]
        );
        let request = envelope(SOAP11_NS, &format!("<b:Message>{split}</b:Message>"));
        let parsed = parse_envelope(request.as_bytes(), &HashMap::new()).expect("parses");
        assert_eq!(parsed.message, line);
        let not_utf8 = [envelope(SOAP11_NS, "").as_bytes(), &[0xff, 0xfe]].concat();
        assert!(parse_envelope(&not_utf8, &HashMap::new()).is_err());
    }

    #[test]
    fn faults_carry_the_code() {
        let fault = fault_envelope(SoapVersion::V12, ReasonCode::Auth, "a < b");
        assert!(fault.contains("<soap:Value>soap:Sender</soap:Value>"));
        assert!(fault.contains("E_AUTH: a &lt; b"));
        assert!(fault.contains("<ste:Code>E_AUTH</ste:Code>"));
        let wsdl = wsdl("http://h/soap");
        assert!(wsdl.contains("soap12:address location=\"http://h/soap\""));
    }
}
